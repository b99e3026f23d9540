"""The pods' scenario, played on what scripts/kube_play.py started (tests/deploy/test_pods.py with the stub
replica
image, scripts/deploy_smoke.py with real vLLM): every kvgate pod ready; a completion for a logical ID through
each kvgate's container port; ``kvgate publish`` in a kvgate pod (as docs/deploy.md says to), then a
rollback, a publish and a bump with ``redis-cli --eval`` in the Redis master's pod, each reaching every
kvgate (its /kvgate/status) and the next completion (the replica loads the version from the store path);
then the Redis master's container stopped: the sentinels promote a replica, kvgate keeps serving, a change
made on the new master reaches it, and the old master comes back as a replica.

Every check raises ScenarioFailed with what was seen; ``report`` gets one line per step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai

from scripts.kube_play import Plan, pod_ip, podman

ID = "tenant-42"
KEYS = {
    "bump_epoch": ["state", "history", "log", "rows", "check"],
    "rollback_version": ["state", "versions", "history", "log", "rows", "check"],
    "publish_version": ["state", "versions", "history", "log", "rows", "check"],
}


class ScenarioFailed(AssertionError):
    pass


@dataclass
class Pods:
    played: Plan
    token: str
    kvgates: list[str]  # pod names with a kvgate container
    replicas: list[str]  # pod names with a vLLM (or stub) container
    report: Callable[[str], None]

    def kvgate_url(self, pod: str, port: int = 8080) -> str:
        return f"http://{pod_ip(self.played, pod)}:{port}"

    def redis_cli(self, pod: str, *args: str, stdin: bytes | None = None) -> str:
        done = podman("exec", "-i", f"{pod}-redis", "redis-cli", *args, stdin=stdin)
        return done.stdout.decode().strip()

    def master(self) -> str:
        """The Redis pod the sentinels name as master now (asked in the first Redis pod that answers)."""
        for pod in ("redis-0", "redis-1", "redis-2"):
            ask = ("redis-cli", "-p", "26379", "--raw", "sentinel", "get-master-addr-by-name", "kvgate")
            done = podman("exec", f"{self.played.namespace}{pod}-sentinel", *ask, check=False)
            if done.returncode == 0 and done.stdout.strip():
                return self.played.namespace + done.stdout.decode().split()[0].split(".")[0]
        raise ScenarioFailed("no sentinel names a master")


def kvgate_pods(played: Plan) -> list[str]:
    return [p.name for p in played.pods if p.labels.get("kvgate.dev/kvgate") == "true"]


def replica_pods(played: Plan) -> list[str]:
    return [p.name for p in played.pods if p.labels.get("kvgate.dev/vllm") == "true"]


async def until(check: Callable[[], Any], what: str, within: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + within
    last: object = None
    while time.monotonic() < deadline:
        try:
            if found := await check():
                return found
        except (aiohttp.ClientError, OSError, RuntimeError, KeyError) as error:  # ScenarioFailed too
            last = error
        await asyncio.sleep(every)
    raise ScenarioFailed(f"not within {within:.0f} s: {what} (last: {last!r})")


async def status(pods: Pods, pod: str) -> dict[str, Any]:
    headers = {"x-kvgate-admin-token": pods.token}
    async with aiohttp.ClientSession() as http, http.get(f"{pods.kvgate_url(pod, 9090)}/kvgate/status",
                                                         headers=headers) as answer:  # fmt: skip
        if answer.status != 200:
            raise ScenarioFailed(f"{pod} /kvgate/status: {answer.status}")
        doc: dict[str, Any] = await answer.json()
        return doc


async def everywhere(
    pods: Pods, what: str, holds: Callable[[dict[str, Any]], bool], within: float = 30
) -> None:
    """Every kvgate's /kvgate/status satisfies ``holds`` (each follows the change log)."""
    for pod in pods.kvgates:

        async def check(pod: str = pod) -> bool:
            return holds(await status(pods, pod))

        await until(check, f"{pod}: {what}", within)


async def complete(pods: Pods, pod: str, prompt: str = "The adapter says") -> str:
    client = openai.AsyncOpenAI(base_url=f"{pods.kvgate_url(pod)}/v1", api_key="unused", max_retries=0)
    try:
        answer = await client.completions.create(model=ID, prompt=prompt, max_tokens=8, temperature=0)
    finally:
        await client.close()
    if answer.model != ID or not answer.choices:
        raise ScenarioFailed(f"{pod}: {answer}")
    return answer.choices[0].text


async def loaded(pods: Pods, digest: str) -> None:
    """Some replica lists the version by its versioned name, loaded from its store path."""
    name, path = f"{ID}@{digest[:16]}", f"/adapters/{digest}"
    for pod in pods.replicas:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{pod_ip(pods.played, pod)}:8000/v1/models") as got,
        ):
            roots = {m["id"]: m.get("root") for m in (await got.json())["data"]}
        if roots.get(name) == path:
            return
    raise ScenarioFailed(f"no replica lists {name} from {path}")


def publish_in_pod(pods: Pods, pod: str, adapter: Path, tag: str) -> str:
    """``kubectl cp`` then ``kubectl exec ... kvgate publish``, as docs/deploy.md does it."""
    container = f"{pod}-kvgate"
    podman("cp", str(adapter), f"{container}:/tmp/{tag}")
    done = podman("exec", container, "kvgate", "publish", "--json", ID, f"/tmp/{tag}")
    return str(json.loads(done.stdout)["digest"])


def eval_script(pods: Pods, pod: str, script: str, *argv: str) -> list[str]:
    """``redis-cli --eval`` of ``kvgate script NAME`` (the operator guide's lines) in a Redis pod."""
    text = podman("exec", f"{pods.kvgates[0]}-kvgate", "kvgate", "script", script).stdout
    podman("exec", "-i", f"{pod}-redis", "sh", "-c", f"cat > /tmp/{script}.lua", stdin=text)
    keys = [f"kvg:{{epochs}}:{key}" + (f":{ID}" if key in ("state", "versions", "history") else "")
            for key in KEYS[script]]  # fmt: skip
    return pods.redis_cli(pod, "--eval", f"/tmp/{script}.lua", *keys, ",", *argv).split("\n")


def now_ms() -> str:
    return str(int(time.time() * 1000))


async def changes(pods: Pods, v1: Path, v2: Path) -> tuple[str, str]:
    first = pods.kvgates[0]
    d1 = publish_in_pod(pods, first, v1, "v1")
    await everywhere(pods, f"current {d1[:16]}", lambda s: s["versions"][ID]["digest"] == d1)
    texts = {pod: await complete(pods, pod) for pod in pods.kvgates}
    await loaded(pods, d1)
    pods.report(
        f"kvgate publish {ID} (v1) in {first}: {d1[:16]}; completions through {len(texts)} kvgate(s): {texts}"
    )
    d2 = publish_in_pod(pods, first, v2, "v2")
    await everywhere(pods, f"current {d2[:16]}", lambda s: s["versions"][ID]["digest"] == d2)
    texts = {pod: await complete(pods, pod) for pod in pods.kvgates}
    await loaded(pods, d2)
    pods.report(f"kvgate publish {ID} (v2): {d2[:16]}; completions: {texts}")

    master = pods.master()
    answer = eval_script(pods, master, "rollback_version", ID, "", "base", now_ms(), "10000", "100", "8")
    if answer[0] != "1" or answer[-1] != d1:
        raise ScenarioFailed(f"rollback: {answer}")
    await everywhere(pods, f"rolled back to {d1[:16]}", lambda s: s["versions"][ID]["digest"] == d1)
    await complete(pods, pods.kvgates[-1])
    pods.report(f"redis-cli --eval rollback_version in {master}: {answer}; every kvgate serves {d1[:16]}")

    version = json.loads(pods.redis_cli(master, "hget", f"kvg:{{epochs}}:versions:{ID}", f"base|{d2}"))
    answer = eval_script(pods, master, "publish_version", ID, d2, version["name"], version["path"], "base",
                         now_ms(), "10000", "100", version.get("base_print", ""))  # fmt: skip
    if answer[0] != "1":
        raise ScenarioFailed(f"publish_version: {answer}")
    await everywhere(pods, f"published {d2[:16]}", lambda s: s["versions"][ID]["digest"] == d2)
    pods.report(f"redis-cli --eval publish_version {d2[:16]} in {master}: {answer}")
    return d1, d2


async def bump(pods: Pods, pod: str) -> int:
    epoch = int((await status(pods, pods.kvgates[0]))["versions"][ID]["epoch"])
    answer = eval_script(pods, pod, "bump_epoch", ID, now_ms(), "10000", "100")
    if answer[0] != "1" or int(answer[1]) != epoch + 1:
        raise ScenarioFailed(f"bump from epoch {epoch}: {answer}")
    await everywhere(pods, f"epoch {epoch + 1}", lambda s: s["versions"][ID]["epoch"] == epoch + 1)
    return epoch + 1


async def failover(pods: Pods) -> None:
    old = pods.master()
    outcomes: list[tuple[float, bool]] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            for pod in pods.kvgates:
                try:
                    await complete(pods, pod)
                    outcomes.append((time.monotonic(), True))
                except (openai.APIError, ScenarioFailed):
                    outcomes.append((time.monotonic(), False))
            await asyncio.sleep(0.2)

    running = asyncio.ensure_future(traffic())
    await asyncio.sleep(2)
    killed = time.monotonic()
    podman("stop", "-t", "0", f"{old}-redis")  # SIGKILL, and podman does not restart a stopped container

    async def promoted() -> str | None:
        new = await asyncio.to_thread(pods.master)
        return new if new != old else None

    new = await until(promoted, "the sentinels promote a replica", within=60)
    promoted_s = time.monotonic() - killed
    epoch = await bump(pods, new)
    reached_s = time.monotonic() - killed
    await asyncio.sleep(3)
    stop.set()
    await running
    after = [ok for at, ok in outcomes if at > killed]
    failed = len(after) - sum(after)
    podman("start", f"{old}-redis")

    async def rejoined() -> bool:
        return "role:slave" in await asyncio.to_thread(pods.redis_cli, old, "info", "replication")

    await until(rejoined, f"{old} back as a replica", within=60)
    pods.report(
        f"failover: stopped {old}-redis; {new} promoted after {promoted_s:.1f} s; a redis-cli bump on {new} "
        f"(epoch {epoch}) reached every kvgate {reached_s:.1f} s after the stop; completions during it: "
        f"{len(after) - failed} ok, {failed} failed; {old} came back as a replica"
    )
    if not after or sum(after[-3:]) < min(3, len(after)):
        raise ScenarioFailed(f"kvgate did not keep serving through the failover: {after}")


async def run(pods: Pods, v1: Path, v2: Path, within: float) -> None:
    started = time.monotonic()
    for pod in pods.kvgates:

        async def ready(pod: str = pod) -> bool:
            async with aiohttp.ClientSession() as http, http.get(f"{pods.kvgate_url(pod)}/healthz") as got:
                return got.status == 200

        await until(ready, f"{pod} /healthz 200", within, every=2)
    pods.report(f"{len(pods.kvgates)} kvgate pod(s) ready after {time.monotonic() - started:.0f} s")
    await changes(pods, v1, v2)
    epoch = await bump(pods, pods.master())
    await complete(pods, pods.kvgates[0])
    pods.report(f"redis-cli --eval bump_epoch in {pods.master()}: epoch {epoch} on every kvgate")
    await failover(pods)
