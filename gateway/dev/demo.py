"""``kvgate demo``: the fault and the cure side by side, on one machine, with no downloads.

It starts an embedded Redis, two real vLLM CPU replicas serving the tiny local model, and kvgate.
Direct path: ``tenant-42`` is loaded from a mutable path, warmed, its bytes replaced by v2 and
reloaded in place; the warm answer then disagrees with a cold one (the fault). Through kvgate: v1 is
published and warmed on both replicas, v2 is published under the same logical ID, and on each
replica the warm answer equals the cold one.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.errors import AuditError
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, kv_events_args, start_replicas
from gateway.process.http_edge import free_port, running
from gateway.proof.audit import COHERENT, DirectTarget, GatewayTarget, Verdict, audit_before_after, render
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis

LOGICAL_ID = "tenant-42"
DEMO_TOKEN = "demo-admin-token"


@dataclass(frozen=True)
class Row:
    path: str
    verdict: Verdict

    @property
    def coherent(self) -> bool:
        return self.verdict.verdict == COHERENT


async def run_demo(settings: Settings, *, vllm_python: Path, fixture_dir: Path) -> bool:
    """Run the experiment and print the table; True when it showed the fault and the cure."""
    work = settings.data_dir.resolve() / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    specs = [
        VllmReplicaSpec(  # publishing KV events: kvgate routes on them by default
            vllm_python,
            fixture_dir / "model",
            free_port(),
            work / f"vllm-{i}.log",
            extra_args=kv_events_args(),
        )
        for i in (0, 1)
    ]
    print(f"starting embedded Redis and two vLLM CPU replicas (logs in {work}) ...", flush=True)
    with EmbeddedRedis(work) as redis_server:
        replicas = await start_replicas(specs)
        try:
            async with aiohttp.ClientSession() as http:
                direct = await direct_inplace_reload(http, replicas[0].url, fixture_dir, work)
                cured = await through_kvgate(http, replicas, redis_server.url, fixture_dir, work)
        finally:
            await asyncio.gather(*(replica.stop() for replica in replicas))
    print_table([*direct, *cured])
    showed = not any(row.coherent for row in direct) and all(row.coherent for row in cured)
    print("\nresult:", "the fault on the direct path, coherent through kvgate" if showed else "UNEXPECTED")
    return showed


async def direct_inplace_reload(
    http: aiohttp.ClientSession, url: str, fixture_dir: Path, work: Path
) -> list[Row]:
    """vLLM alone: same name, same path, new bytes, reloaded in place; audited before and after."""
    mutable = work / "mutable" / LOGICAL_ID
    shutil.copytree(fixture_dir / "adapters" / "v1", mutable)
    await _post(http, f"{url}/v1/load_lora_adapter", {"lora_name": LOGICAL_ID, "lora_path": str(mutable)})

    async def reload_in_place() -> str | None:
        for item in (fixture_dir / "adapters" / "v2").iterdir():
            shutil.copyfile(item, mutable / item.name)
        reload = {"lora_name": LOGICAL_ID, "lora_path": str(mutable), "load_inplace": True}
        await _post(http, f"{url}/v1/load_lora_adapter", reload)
        return None

    target = DirectTarget((url,), LOGICAL_ID)
    _, after = await audit_before_after(http, target, reload_in_place)
    await _post(http, f"{url}/v1/unload_lora_adapter", {"lora_name": LOGICAL_ID})
    print("\n" + render("direct audit, after the in-place reload:", after), flush=True)
    return [Row("direct, in-place reload", verdict) for verdict in after]


async def through_kvgate(
    http: aiohttp.ClientSession, replicas: list[VllmProcess], redis_url: str, fixture_dir: Path, work: Path
) -> list[Row]:
    """The same steps through kvgate: publish v1, audit (warms every replica), publish v2, audit."""
    store = AdapterStore(work / "store")
    settings = Settings(
        replicas=[replica.url for replica in replicas],
        store=store.root,
        data_dir=work,
        reconcile_interval=0.2,
        poll_interval=0.5,
        drain_grace=5.0,
        admin_token=DEMO_TOKEN,
    )
    redis = Redis.from_url(redis_url)
    table = EpochTable(redis)
    try:
        async with running(build_app(settings, redis)) as url:
            target = GatewayTarget(url, LOGICAL_ID, DEMO_TOKEN)

            async def publish(version: str) -> str | None:
                adapter = fixture_dir / "adapters" / version
                done = await publish_adapter(table, store, LOGICAL_ID, adapter, settings.base_identity)
                print(
                    f"published {version}: {done.name} (epoch {done.change.epoch}, {done.path})", flush=True
                )
                await target.until_serving(http, done.digest)
                return done.digest

            await publish("v1")
            _, after = await audit_before_after(http, target, lambda: publish("v2"))
    finally:
        await redis.aclose()
    print("\n" + render("audit through kvgate, after publishing v2:", after), flush=True)
    return [Row("through kvgate", verdict) for verdict in after]


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with http.post(url, json=body) as response:
        if response.status != 200:
            raise AuditError(f"{url} answered {response.status}: {await response.text()}")


def print_table(rows: list[Row]) -> None:
    columns = (
        f"{'PATH':<24} {'REPLICA':<16} {'SERVED':<27} {'DIGEST':<17} {'CACHED':>6}  {'WARM':<22} {'COLD':<22}"
    )
    header = f"{columns} WARM==COLD"
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        obs = row.verdict.observation
        warm, cold = obs.warm[-1], obs.cold[0]
        same = "yes" if warm.agrees_with(cold) else f"NO (max |dlogprob| {warm.max_logprob_diff(cold):.3f})"
        replica, digest = row.verdict.replica.removeprefix("http://"), (obs.digest or "?")[:16]
        print(
            f"{row.path:<24} {replica:<16} {obs.served:<27} {digest:<17} {warm.cached_tokens:>6}  "
            f"{_short(warm.text):<22} {_short(cold.text):<22} {same}"
        )


def _short(text: str, width: int = 20) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 3] + "...'"
