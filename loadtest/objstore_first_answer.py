"""Publish to the first answer on two real vLLM replicas: the object store (S3, an agent per replica) against
the directory store, for a small adapter and a 200 MB one.

Two vLLM CPU replicas (the tiny fixture model), one embedded Redis, moto's S3 server (a process), kvgate
in this process: once with the directory store, once with ``s3://`` and a ``kvgate agent`` per replica
(a local directory each). Each round publishes a fresh version (the fixture's v1 plus a file of random
bytes, so every round is a new digest: nothing is cached anywhere), then asks both replicas at once
(pinned, through kvgate) and stops the clock when both answered. The 200 MB adapter is the same v1 plus
a 200 MB file beside it: vLLM reads only the weights, but the store, the agent and the checks move all of
it, as they would a 200 MB LoRA. The rounds interleave the modes; medians of ROUNDS.

    make loadtest-objstore            # ROUNDS=3 by default
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.objstore import ObjectStore
from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.agent.server import build_agent
from gateway.app.wiring import build_app
from gateway.core.errors import AuditError
from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER
from gateway.dev import generated_docs
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, start_replicas
from gateway.process.http_edge import free_port, running
from gateway.proof.experiment import complete
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.s3_server import environment, s3_server

ADMIN = "bench-admin"
AGENT_TOKEN = "bench-agent"
SIZES = {"small": 0, "200 MB": 200 << 20}


def adapter(fixture: Path, work: Path, padding: int, tag: str) -> Path:
    root = work / f"adapter-{tag}"
    shutil.copytree(fixture / "adapters" / "v1", root)
    (root / "padding.bin").write_bytes(os.urandom(padding or 16))
    return root


async def first_answers(
    http: aiohttp.ClientSession, url: str, logical: str, replicas: list[VllmProcess]
) -> None:
    async def one(replica: VllmProcess) -> None:
        """Asked again while kvgate does not know the ID yet (a 404: the change is on its way to its
        snapshot, which counts in the time), never past a minute."""
        pin = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN}
        deadline = time.monotonic() + 60
        while True:
            try:
                sample = await complete(http, url, logical, "Hello", max_tokens=1, headers=pin)
                break
            except AuditError as exc:
                if "answered 404" not in str(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        assert sample.evidence["x-kvgate-version"].startswith(f"{logical}@"), sample.evidence

    await asyncio.gather(*(one(replica) for replica in replicas))


async def run(args: argparse.Namespace) -> str:
    work = Path(tempfile.mkdtemp(prefix="objstore-first-"))
    fixture = Path(args.fixture_dir)
    times: dict[tuple[str, str], list[float]] = {}
    async with AsyncExitStack() as stack:
        server = stack.enter_context(s3_server(work / "moto.log"))
        stack.enter_context(environment(server.environment()))
        redis_server = stack.enter_context(EmbeddedRedis(work / "redis"))
        python = Path(args.vllm_python)
        specs = [
            VllmReplicaSpec(python, fixture / "model", free_port(), work / f"vllm-{i}.log") for i in (0, 1)
        ]
        replicas = await start_replicas(specs)
        stack.push_async_callback(lambda: asyncio.gather(*(r.stop() for r in replicas)))
        redis = Redis.from_url(redis_server.url)
        stack.push_async_callback(redis.aclose)
        http = await stack.enter_async_context(aiohttp.ClientSession())
        s3_url = f"s3://{server.new_bucket()}/store"
        agents = []
        for i, replica in enumerate(replicas):
            local = work / f"agent-{i}"
            app = build_agent(
                s3_url,
                local,
                token=AGENT_TOKEN,
                replica_url=replica.url,
                agent_root=str(local),
                disk_bytes=1 << 40,
            )
            agents.append(f"{replica.url}={await stack.enter_async_context(running(app))}|{local}")
        common: dict[str, Any] = {
            "replicas": [r.url for r in replicas],
            "admin_token": ADMIN,
            "reconcile_interval": 0.2,
            "poll_interval": 0.5,
            "drain_grace": 0.5,
        }
        modes: dict[str, tuple[Settings, AdapterStore | ObjectStore]] = {
            "directory": (Settings(store=str(work / "store"), **common), AdapterStore(work / "store")),
            "object store + agents": (
                Settings(store=s3_url, replica_agents=agents, agent_token=AGENT_TOKEN, **common),
                ObjectStore(s3_url),
            ),
        }
        table = EpochTable(redis)
        for round_ in range(args.rounds):
            for size, padding in SIZES.items():
                for mode, (settings, store) in modes.items():
                    logical = f"bench-{round_}-{size.split()[0]}-{mode.split()[0]}"
                    source = adapter(fixture, work, padding, logical)
                    async with running(build_app(settings, redis)) as url:
                        await _until_ready(http, url, len(replicas))
                        started = time.perf_counter()
                        await publish_adapter(table, store, logical, source, "base")
                        await first_answers(http, url, logical, replicas)
                        times.setdefault((size, mode), []).append(time.perf_counter() - started)
                    shutil.rmtree(source)
                    for replica in replicas:  # room for the next round (vLLM's --max-loras)
                        await _unload_all(http, replica)
                    took = times[(size, mode)][-1]
                    print(f"round {round_} {size:>6} {mode:<22} {took:6.2f} s", flush=True)
    lines = [
        f"Publish (store write + epoch table) to the first answer from both replicas, medians of"
        f" {args.rounds}"
        " rounds (the modes interleaved, a new digest each time).",
        "",
        "| adapter | store | median s | every round (s) |",
        "| --- | --- | ---: | --- |",
    ]
    for (size, mode), values in times.items():
        lines.append(f"| {size} | {mode} | {statistics.median(values):.2f} | "
                     f"{', '.join(f'{v:.2f}' for v in values)} |")  # fmt: skip
    return "\n".join(lines)


async def _until_ready(http: aiohttp.ClientSession, url: str, count: int) -> None:
    """Until this kvgate has polled every replica healthy (the clock starts after)."""
    for _ in range(600):
        try:
            async with http.get(f"{url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN}) as answer:
                status = await answer.json() if answer.status == 200 else {}
            if sum(1 for r in status.get("replicas", []) if r.get("healthy")) == count:
                return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never saw its {count} replicas healthy")


async def _unload_all(http: aiohttp.ClientSession, replica: VllmProcess) -> None:
    async with http.get(f"{replica.url}/v1/models") as answer:
        models = (await answer.json())["data"]
    for model in models:
        if model.get("parent"):
            async with http.post(
                f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": model["id"]}
            ) as _:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--fixture-dir", required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    generated_docs.started_tree()
    report = asyncio.run(run(args))
    print(report)
    if args.out:
        generated_docs.write_block(args.out, generated_docs.measured(report))
    sys.exit(0)


if __name__ == "__main__":
    main()
