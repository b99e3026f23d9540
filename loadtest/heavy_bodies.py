"""Do heavy bodies stall kvgate's event loop? ``/healthz`` latency while 8 clients send 4 MB prompts.

Every server runs in its own process on loopback: the vLLM-API stub (``loadtest/stub_server.py``) and
``kvgate serve`` (an adapter published through ``kvgate publish``, embedded Redis), started with the
helpers of ``loadtest/proxy_overhead.py``. Each round, ``--clients`` concurrent clients each send
``--requests`` completions whose prompt is a list of token ids just under kvgate's body limit (4 MiB),
while a prober here sends ``GET /healthz`` back to back. ``/healthz`` does no work of its own, so its
latency is how long the event loop was busy with something else. The same probe on an idle kvgate is the
baseline. Figures are medians over rounds (the machine is shared and noisy).

Run from the repository root::

    .venv/bin/python -m loadtest.heavy_bodies [--rounds 3] [--clients 8] [--requests 3] \
        [--out docs/edge-parsing.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.proxy_overhead import LOGICAL_ID, Fleet, publish, stop_leftover_redis, wait_ready

BODY_LIMIT = 4 * 1024 * 1024  # kvgate's default max_body_bytes


def heavy_body(size: int, seed: int) -> bytes:
    """A completion request whose prompt is token ids, ``size`` bytes at most (and close to it)."""
    rng = random.Random(seed)
    head = {"model": LOGICAL_ID, "max_tokens": 1, "temperature": 0.0, "cache_salt": "client-chosen"}
    tokens: list[int] = []
    length = len(json.dumps(head)) + len(', "prompt": []')
    while True:
        token = rng.randrange(150_000)
        extra = len(str(token)) + 2
        if length + extra > size:
            break
        tokens.append(token)
        length += extra
    return json.dumps({**head, "prompt": tokens}).encode()


@dataclass
class Round:
    probes_ms: list[float]
    requests_ms: list[float]
    errors: list[str]

    def probe_median(self) -> float:
        return statistics.median(self.probes_ms)

    def probe_p90(self) -> float:
        return (
            statistics.quantiles(self.probes_ms, n=10)[-1] if len(self.probes_ms) > 1 else self.probes_ms[0]
        )

    def probe_max(self) -> float:
        return max(self.probes_ms)


async def probe_once(session: aiohttp.ClientSession, url: str) -> float:
    """One ``GET /healthz``; its latency in ms."""
    started = time.perf_counter()
    async with session.get(url + "/healthz") as response:
        await response.read()
    return (time.perf_counter() - started) * 1e3


async def probe(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        out.append(await probe_once(session, url))
        await asyncio.sleep(0.005)


async def idle(session: aiohttp.ClientSession, url: str, count: int = 50) -> list[float]:
    out = []
    for _ in range(count):
        out.append(await probe_once(session, url))
        await asyncio.sleep(0.005)
    return out


async def heavy_round(
    session: aiohttp.ClientSession, url: str, body: bytes, args: argparse.Namespace
) -> Round:
    stop = asyncio.Event()
    probes: list[float] = []
    latencies: list[float] = []
    errors: list[str] = []

    async def client() -> None:
        for _ in range(args.requests):
            started = time.perf_counter()
            headers = {"Content-Type": "application/json"}
            async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
                answer = await response.read()
            latencies.append((time.perf_counter() - started) * 1e3)
            if response.status != 200 or f'"model":"{LOGICAL_ID}"'.encode() not in answer:
                errors.append(f"{response.status} {answer[:200]!r}")

    prober = asyncio.ensure_future(probe(session, url, stop, probes))
    await asyncio.gather(*(client() for _ in range(args.clients)))
    stop.set()
    await prober
    return Round(probes, latencies, errors)


async def bench(url: str, args: argparse.Namespace) -> tuple[list[float], list[Round]]:
    body = heavy_body(BODY_LIMIT - 1024, seed=1)
    print(f"body: {len(body):,} bytes, {body.count(b',') - 3:,} token ids", flush=True)
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=args.clients + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        warm = await heavy_round(session, url, body, argparse.Namespace(clients=1, requests=1))
        if warm.errors:
            raise RuntimeError("the warm-up request failed")
        baseline = await idle(session, url)
        print(f"idle /healthz: median {statistics.median(baseline):.1f} ms", flush=True)
        rounds = []
        for number in range(args.rounds):
            result = await heavy_round(session, url, body, args)
            rounds.append(result)
            print(f"  round {number + 1}: /healthz median {result.probe_median():7.1f} ms, p90 "
                  f"{result.probe_p90():7.1f} ms, max "
                  f"{result.probe_max():7.1f} ms ({len(result.probes_ms)} probes); heavy request median "
                  f"{statistics.median(result.requests_ms):7.1f} ms, {len(result.errors)} errors",
                  *result.errors, sep="\n    ", flush=True)  # fmt: skip
    return baseline, rounds


def report(baseline: list[float], rounds: list[Round], args: argparse.Namespace) -> str:
    def med(values: Sequence[float]) -> str:
        return f"{statistics.median(values):,.1f}"

    errors = sum(len(r.errors) for r in rounds)
    return "\n".join([
        "| idle /healthz median | under load: median | p90 | max | heavy request median | errors |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {med(baseline)} ms | {med([r.probe_median() for r in rounds])} ms "
        f"| {med([r.probe_p90() for r in rounds])} ms | {med([r.probe_max() for r in rounds])} ms "
        f"| {med([statistics.median(r.requests_ms) for r in rounds])} ms "
        f"| {errors} of {args.rounds * args.clients * args.requests} |",
    ])  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.heavy_bodies", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent heavy clients (default 8)")
    parser.add_argument("--requests", type=int, default=3, help="heavy requests per client and round")
    parser.add_argument("--out", type=Path, help="write the figures into this doc's generated block")
    args = parser.parse_args(argv)
    if min(args.rounds, args.clients, args.requests) < 1:
        parser.error("--rounds, --clients and --requests must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="kvgate-heavy-") as tmp:
        workdir = Path(tmp)
        with Fleet(workdir) as fleet:
            fleet.callback(stop_leftover_redis, workdir)  # runs after kvgate has stopped
            stub_port = free_port()
            stub = fleet.start("stub", [py, "-m", "loadtest.stub_server", "--port", str(stub_port)])
            stub_url = f"http://127.0.0.1:{stub_port}"
            wait_ready(stub, stub_url + "/v1/models")
            publish(workdir)
            kv_port = free_port()
            kvgate = fleet.start("kvgate", [py, "-m", "gateway.cli", "serve", "--replica", stub_url,
                                            "--data-dir", str(workdir / "kvgate"),
                                            "--store", str(workdir / "store"),
                                            "--port", str(kv_port), "--workers", "1"])  # fmt: skip
            kv_url = f"http://127.0.0.1:{kv_port}"
            wait_ready(kvgate, kv_url + "/healthz")
            baseline, rounds = asyncio.run(bench(kv_url, args))
    text = report(baseline, rounds, args)
    print("figures under load are medians over rounds of each round's median, p90 and max")
    print(text)
    if args.out is not None:
        size = len(heavy_body(BODY_LIMIT - 1024, seed=1))
        generated_docs.write_block(args.out, generated_docs.measured(
            f"{args.clients} clients, {args.requests} heavy requests each per round ({size:,} bytes a body), "
            f"{args.rounds} rounds; each figure under load is the median over rounds of each round's median, "
            f"p90 and maximum.\n\n{text}"
        ))  # fmt: skip
    return 1 if any(r.errors for r in rounds) else 0


if __name__ == "__main__":
    raise SystemExit(main())
