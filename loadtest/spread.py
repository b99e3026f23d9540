"""Does a hot version spread? (issue 9, #2): time from the load bound being crossed on the only replica
that holds a version until the second replica serves it.

One ``kvgate serve`` process (the bound is per kvgate: it counts its own in-flight requests) in front of
two real vLLM CPU replicas, on a ``redis-server`` of its own. Each round publishes a fresh logical ID,
loads its version on replica A only (one request pinned there with the admin token), then starts a burst
of concurrent streaming requests through kvgate, each client sending back to back. With two replicas the
third request in flight crosses A's bounded share (1.25x the fair share), so the scheduler decides
"load there too" (``spread``). Measured per round, from the moment the third request of the burst was
sent: the first response served by replica B (its evidence header), and when kvgate's status first lists
the version on B; then the share of the burst's requests each replica served.

    .venv/bin/python -m loadtest.spread --vllm-python .venv-vllm/bin/python --fixture-dir .cache/fixture \\
        --out docs/chaos.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER, REPLICA_HEADER
from gateway.dev import generated_docs
from gateway.dev.vllm_process import VllmReplicaSpec, start_replicas
from gateway.process.http_edge import free_port
from loadtest.chaos import SHAPES, TOKEN, Kvgate, RedisServer, kvgate_cli, request_body, write_section

CROSSING = 3  # with two replicas, the third request in flight is over the holder's bounded share


@dataclass
class Round:
    name: str
    to_first_answer_s: float | None  # bound crossed -> first response served by replica B
    to_listed_s: float | None  # bound crossed -> kvgate's status lists the version on B
    share_b: float  # of the burst's requests, the share B served
    requests: int


async def publish(redis_url: str, store: Path, logical_id: str, adapter: Path) -> None:
    argv = kvgate_cli("publish", logical_id, str(adapter), "--redis-url", redis_url, "--store", str(store))
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL)
    if await process.wait() != 0:
        raise RuntimeError(f"publishing {logical_id} failed")


async def one_round(
    http: aiohttp.ClientSession, gateway: Kvgate, tenant: int, a: str, b: str, args: argparse.Namespace
) -> Round:
    shape = next(s for s in SHAPES if s.name == "completion-stream-long")
    name = f"tenant-{tenant}"
    pinned = request_body(shape, tenant, 0) | {"max_tokens": 1}
    pin = {ADMIN_TOKEN_HEADER: TOKEN, PIN_HEADER: a}
    async with http.post(f"{gateway.url}/v1/completions", json=pinned, headers=pin) as response:
        await response.read()
        if response.status != 200 or response.headers.get(REPLICA_HEADER) != a:
            raise RuntimeError(f"the pinned warm-up was not served on {a}: {response.status}")
    status = await gateway.status(http)
    holders = [r["url"] for r in status["replicas"] if any(n.startswith(f"{name}@") for n in r["adapters"])]
    if holders != [a]:
        raise RuntimeError(f"{name} should be on {a} only, is on {holders}")

    sent: list[float] = []
    served: Counter[str] = Counter()
    first_b: list[float] = []
    stop = asyncio.Event()

    async def client(k: int) -> None:
        question = k
        while not stop.is_set():
            question += args.clients
            body = request_body(shape, tenant, question % 24) | {"max_tokens": args.max_tokens}
            sent.append(time.monotonic())
            async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
                replica = response.headers.get(REPLICA_HEADER, "?")
                if replica == b and not first_b:
                    first_b.append(time.monotonic())
                await response.read()
                served[replica] += response.status == 200

    async def listed_on_b() -> float | None:
        deadline = time.monotonic() + args.burst_seconds
        while time.monotonic() < deadline:
            doc = await gateway.status(http)
            adapters = next(r["adapters"] for r in doc["replicas"] if r["url"] == b)
            if any(n.startswith(f"{name}@") for n in adapters):
                return time.monotonic()
            await asyncio.sleep(0.01)
        return None

    clients = [asyncio.create_task(client(k)) for k in range(args.clients)]
    listed = await listed_on_b()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, args.burst_seconds - (time.monotonic() - sent[0])))
    stop.set()
    await asyncio.gather(*clients)
    crossed = sorted(sent)[CROSSING - 1]
    total = sum(served.values())
    return Round(
        name,
        first_b[0] - crossed if first_b else None,
        listed - crossed if listed is not None else None,
        served[b] / total if total else 0.0,
        total,
    )


def report(rounds: list[Round], args: argparse.Namespace) -> str:
    answered = [r.to_first_answer_s for r in rounds if r.to_first_answer_s is not None]
    lines = [
        f"One kvgate, two vLLM CPU replicas, {args.clients} clients sending "
        f"{args.max_tokens}-token streams back to back for {args.burst_seconds:g} s per round, a fresh "
        "logical ID per round loaded on replica A only.",
        "",
        "| round | bound crossed → first answer from B (s) | → B listed in kvgate's status (s) "
        "| requests | share served by B |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {r.name} | {_s(r.to_first_answer_s)} | {_s(r.to_listed_s)} | {r.requests} | {r.share_b:.2f} |"
            for r in rounds
        ),
        "",
        f"Median {_s(statistics.median(answered) if answered else None)} s, max "
        f"{_s(max(answered) if answered else None)} s to the first answer from B (target: within 2 s); "
        f"{len(rounds) - len(answered)} of {len(rounds)} rounds never spread.",
    ]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f}"


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvgate-spread-"))
    redis_server = RedisServer(work / "redis", free_port())
    adapters = sorted((args.fixture_dir / "adapters").iterdir())
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())
        stack.push_async_callback(redis_server.stop)
        await redis_server.start()
        specs = [
            VllmReplicaSpec(args.vllm_python, args.fixture_dir / "model", free_port(), work / f"vllm-{i}.log")
            for i in (0, 1)
        ]
        print(f"starting redis-server, two vLLM replicas and one kvgate (work folder {work}) ...")
        replicas = await start_replicas(specs)
        for replica in replicas:
            stack.push_async_callback(replica.stop)
        store = work / "store"
        argv = kvgate_cli(
            "serve", *(x for r in replicas for x in ("--replica", r.url)), "--redis-url", redis_server.url,
            "--store", str(store), "--data-dir", str(work / "kvgate"), "--port", str(free_port()),
            "--expose-replica-urls", "--drain-grace", "2", "--workers", "1",
        )  # fmt: skip
        gateway = Kvgate(0, argv, int(argv[argv.index("--port") + 1]), work / "kvgate.log")
        stack.push_async_callback(gateway.stop)
        rounds = []
        for k in range(args.rounds):
            await publish(redis_server.url, store, f"tenant-{k}", adapters[k % len(adapters)])
            if k == 0:
                await gateway.start(http)
            await asyncio.sleep(1.5)  # every replica polled since the publish
            a, b = replicas[k % 2].url, replicas[(k + 1) % 2].url
            rounds.append(await one_round(http, gateway, k, a, b, args))
            print(rounds[-1], flush=True)
    body = report(rounds, args)
    write_section(args.out, body, "Spread: a hot version reaches the second replica")
    print(body)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--fixture-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--burst-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("docs/chaos.md"))
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    asyncio.run(main_async(args))
    sys.exit(0)


if __name__ == "__main__":
    main()
