"""One replica's KV events flooded at kvgate beside steady small requests (issue 29; docs/scale.md).

For each worker count (``--workers 1`` and ``2``, in turn, ``--rounds`` times), a fresh ``kvgate serve
--kv-events`` in front of the stub (``loadtest/stub_server.py``), its embedded Redis, the replica's
events published by a child process of this one (``--publish``: a real ZMQ PUB socket, map-encoded
``BlockStored`` batches as vLLM 0.32 sends them, 16-token blocks, unique block hashes, stamped with the
time they are sent). Small requests go through kvgate at a steady ``--rps`` the whole time:

1. **idle**: ``--idle`` seconds with the stream followed and quiet;
2. **flood**: ``--seconds`` seconds of ``--rate`` blocks/s in batches of ``--batch`` blocks (each rate
   given, in turn);
3. **after**: until every batch sent is accounted for in the KV indexer's counters (applied, or
   dropped while the stream lagged), at most ``--after`` seconds.

Measured: the small requests' p50 and p99 in each phase (and their ratio flood / idle); the blocks the
indexer applied per second during the flood; batches applied and dropped; when the last batch was
accounted for after the flood's end; the largest RSS of every kvgate process (parent, workers, KV
indexer; the embedded redis-server left out), sampled every 0.5 s. Run from the repository root::

    .venv/bin/python -m loadtest.kv_flood [--rounds 1] [--rate 100000 500000] [--seconds 15] \\
        [--out docs/scale.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgpack
import zmq

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.proxy_overhead import Fleet, stop_leftover_redis, wait_ready
from loadtest.workers_cost import kvgate_rss_mb

BLOCK = 16  # tokens per block, as on most GPUs
TEMPLATES = 100  # distinct batches the publisher packs ahead and cycles through
TOKENIZER = {
    "version": "1.0",
    "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hi": 1}, "unk_token": "<unk>"},
    "pre_tokenizer": {"type": "Whitespace"},
}


def publish(endpoint: str, go: Path, report: Path, rate: int, seconds: float, batch: int) -> None:
    """The replica's publisher: waits for ``go``, sends ``rate`` blocks/s for ``seconds``, writes what it
    sent to ``report``, and keeps its socket open (a closed publisher is a lost stream) until killed."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    rng = random.Random(1)
    hashes = itertools.count(1)
    seq = 0

    def events_of(blocks: int) -> bytes:
        """A batch's events, packed (a msgpack array): its time is stamped when it is sent."""
        events = [
            {"type": "BlockStored", "block_hashes": [next(hashes)], "parent_block_hash": None,
             "token_ids": [rng.randrange(32000), *range(1, BLOCK)], "block_size": BLOCK,
             "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None], "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"}
            for _ in range(blocks)
        ]  # fmt: skip
        packed: bytes = msgpack.packb(events)
        return packed

    def stamped(events: bytes) -> bytes:
        """``[ts, events, 0]``: the array header, the time now, the packed events, rank 0."""
        now: bytes = msgpack.packb(time.time())
        return b"\x93" + now + events + b"\x00"

    def batch_of(blocks: int) -> bytes:
        return stamped(events_of(blocks))

    templates = [events_of(batch) for _ in range(TEMPLATES)]  # packed ahead: the publisher's CPU is not
    # kvgate's (on a real node it is the replica's host's); hashes repeat every TEMPLATES batches

    def send(payload: bytes) -> None:
        nonlocal seq
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1

    while not go.exists():
        send(batch_of(1))  # a trickle while idle: the stream is followed, the lag baseline learned
        time.sleep(0.5)
    first, began, sent_blocks = seq, time.monotonic(), 0
    interval = batch / rate
    while (now := time.monotonic()) < began + seconds:
        due = began + (seq - first) * interval
        if now < due:
            time.sleep(due - now)
        send(stamped(templates[(seq - first) % TEMPLATES]))
        sent_blocks += batch
    took = time.monotonic() - began
    doc = {"batches": seq - first, "blocks": sent_blocks, "seconds": took, "last_seq": seq - 1,
           "ended": time.time()}  # fmt: skip
    report.write_text(json.dumps(doc))
    while True:
        send(batch_of(1))
        time.sleep(0.5)


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    def p(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass
class Run:
    workers: int
    rate: int  # blocks/s the flood was sent at
    phases: dict[str, Phase]
    sent_batches: int
    sent_blocks: int
    flood_s: float
    applied_blocks_per_s: float
    applied_batches: int
    dropped_batches: int
    accounted_after_s: float | None  # from the flood's end to every batch applied or dropped
    rss_max_mb: float
    rss_by_process: list[float]


DROPPED = "kvgate_kv_event_batches_dropped_total"


async def until(check: Callable[[], Awaitable[bool]], within: float) -> None:
    """Poll ``check`` until it holds, at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {within:g} s")
        await asyncio.sleep(0.2)


async def followed(http: aiohttp.ClientSession, admin: str, stored: str) -> bool:
    return sample(await scrape(http, admin), stored) >= 1


def sample(page: str, name: str) -> float:
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def scrape(http: aiohttp.ClientSession, admin: str) -> str:
    """The merged ``/metrics`` page (the admin listener's: no token)."""
    async with http.get(f"{admin}/metrics") as answer:
        return await answer.text()


async def small_requests(
    url: str, rps: float, phases: dict[str, Phase], current: list[str], stop: asyncio.Event
) -> None:
    body = {"model": "base", "prompt": "hi", "max_tokens": 1}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one() -> None:
            phase = phases[current[0]]
            began = time.perf_counter()
            try:
                async with http.post(f"{url}/v1/completions", json=body) as answer:
                    await answer.read()
                    ok = answer.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                phase.latencies.append(time.perf_counter() - began)
            else:
                phase.errors += 1

        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        for n in itertools.count():
            if stop.is_set():
                break
            due = start + n / rps
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.ensure_future(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)


async def one_run(
    fleet: Fleet, workdir: Path, name: str, workers: int, rate: int, stub_url: str, args: argparse.Namespace
) -> Run:
    port, admin_port, events_port = free_port(), free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    go, report = workdir / f"{name}.go", workdir / f"{name}.report"
    publisher = fleet.start(
        f"{name}-publisher",
        [sys.executable, "-m", "loadtest.kv_flood", "--publish", endpoint, "--go", str(go), "--report",
         str(report), "--rate", str(rate), "--seconds", str(args.seconds), "--batch", str(args.batch)],
    )  # fmt: skip
    tokenizer = workdir / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    (tokenizer / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url,
            "--data-dir", str(workdir / name), "--store", str(workdir / "store"), "--workers", str(workers),
            "--port", str(port), "--admin-port", str(admin_port), "--kv-events",
            "--tokenizer", str(tokenizer), "--kv-event-endpoints", f"{stub_url}={endpoint}"]  # fmt: skip
    serve = fleet.start(name, argv)
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(serve, f"{url}/healthz", timeout=180.0)
        async with aiohttp.ClientSession() as http:
            stored = 'kvgate_kv_events_total{kind="BlockStored"'
            await until(lambda: followed(http, admin, stored), 60.0)  # the trickle arrives
            phases = {"idle": Phase(), "flood": Phase(), "after": Phase()}
            current, stop = ["idle"], asyncio.Event()
            client = asyncio.ensure_future(small_requests(url, args.rps, phases, current, stop))
            rss: dict[int, float] = {}

            async def watch_rss() -> None:
                while not stop.is_set():
                    for i, mb in enumerate(sorted(kvgate_rss_mb(serve.process.pid))):
                        rss[i] = max(rss.get(i, 0.0), mb)
                    await asyncio.sleep(0.5)

            watcher = asyncio.ensure_future(watch_rss())
            await asyncio.sleep(args.idle)
            page = await scrape(http, admin)
            before_events, before_dropped = (
                sample(page, stored),
                sample(page, DROPPED),
            )
            current[0] = "flood"
            go.touch()
            await until(lambda: asyncio.to_thread(report.exists), args.seconds + 60.0)
            current[0] = "after"
            sent = json.loads(report.read_text())
            page = await scrape(http, admin)
            flood_events = sample(page, stored) - before_events
            accounted_after = None
            while time.time() - sent["ended"] < args.after:
                page = await scrape(http, admin)
                applied = (sample(page, stored) - before_events) / args.batch
                dropped = sample(page, DROPPED) - before_dropped
                if applied + dropped >= sent["batches"]:
                    accounted_after = time.time() - sent["ended"]
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(max(0.0, 3.0 - (time.time() - sent["ended"])))  # a few seconds of "after"
            stop.set()
            await asyncio.gather(client, watcher)
            page = await scrape(http, admin)
            applied_blocks = sample(page, stored) - before_events
            dropped = int(sample(page, DROPPED) - before_dropped)
    finally:
        serve.stop(grace=30)
        publisher.stop()
        stop_leftover_redis(workdir, name)
    return Run(
        workers=workers,
        rate=rate,
        phases=phases,
        sent_batches=sent["batches"],
        sent_blocks=sent["blocks"],
        flood_s=sent["seconds"],
        applied_blocks_per_s=flood_events / sent["seconds"],
        applied_batches=int(applied_blocks // args.batch),
        dropped_batches=dropped,
        accounted_after_s=accounted_after,
        rss_max_mb=max(rss.values(), default=0.0),
        rss_by_process=[rss[i] for i in sorted(rss)],
    )


def render(runs: list[Run], args: argparse.Namespace) -> str:
    lines = [
        f"One replica's events at {' and '.join(f'{r:,}' for r in args.rate)} blocks/s "
        f"for {args.seconds:g} s "
        "(map-encoded `BlockStored`, one block each, as a replica serving short prompts sends them, "
        f"{BLOCK}-token blocks, {args.batch:,} blocks a batch), small requests at {args.rps:g}/s throughout, "
        f"the idle phase {args.idle:g} s; {len(os.sched_getaffinity(0))} cores, shared. One row per run.",
        "",
        "| flood blocks/s | workers | idle p50 / p99 ms | flood p50 / p99 ms | p99 flood / idle | "
        "p99 goal: max(2x, +20 ms) | "
        "small errors | sent blocks/s | applied blocks/s (flood) | batches sent / applied / dropped | "
        "all accounted for after the flood | largest RSS of a kvgate process | RSS per process (max, MB) |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for run in runs:
        idle, flood = run.phases["idle"], run.phases["flood"]
        goal = max(2 * idle.p(0.99), idle.p(0.99) + 20)
        met = "met" if flood.p(0.99) <= goal else "missed"
        errors = sum(p.errors for p in run.phases.values())
        after = (
            f"not within {args.after:g} s"
            if run.accounted_after_s is None
            else f"{run.accounted_after_s:.1f} s"
        )
        lines.append(
            f"| {run.rate:,} | {run.workers} | {idle.p(0.5):.1f} / {idle.p(0.99):.1f} | "
            f"{flood.p(0.5):.1f} / {flood.p(0.99):.1f} | "
            f"{flood.p(0.99) / idle.p(0.99):.2f} | {met} ({goal:.1f} ms) | {errors} | "
            f"{run.sent_blocks / run.flood_s:,.0f} | {run.applied_blocks_per_s:,.0f} | "
            f"{run.sent_batches} / {run.applied_batches} / {run.dropped_batches} | {after} | "
            f"{run.rss_max_mb:.0f} MB | {', '.join(f'{mb:.0f}' for mb in run.rss_by_process)} |"
        )
    counts = sorted({(run.rate, run.workers) for run in runs})
    if len(runs) > len(counts):
        lines += ["", "Medians over the runs of each rate and worker count:", ""]
    for rate, workers in counts:
        mine = [run for run in runs if (run.rate, run.workers) == (rate, workers)]
        ratio = statistics.median(r.phases["flood"].p(0.99) / r.phases["idle"].p(0.99) for r in mine)
        added = statistics.median(r.phases["flood"].p(0.99) - r.phases["idle"].p(0.99) for r in mine)
        latest = [r.accounted_after_s for r in mine]
        accounted = (
            "not every batch accounted for"
            if None in latest
            else f"every batch accounted for (applied or dropped) {max(a or 0.0 for a in latest):.1f} s "
            "after the flood at the latest"
        )
        lines.append(
            f"- {rate:,} blocks/s, `--workers {workers}`: small requests' p99 flood / idle x{ratio:.2f} "
            f"({added:+.1f} ms); "
            f"{accounted}; applied {statistics.median(r.applied_blocks_per_s for r in mine):,.0f} blocks/s "
            f"during the flood; largest kvgate process {max(r.rss_max_mb for r in mine):.0f} MB."
        )
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-flood-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        stub_port = free_port()
        stub = fleet.start("stub", [sys.executable, "-m", "loadtest.stub_server", "--port", str(stub_port)])
        stub_url = f"http://127.0.0.1:{stub_port}"
        wait_ready(stub, stub_url + "/v1/models")
        for round_ in range(args.rounds):
            for rate, workers in itertools.product(args.rate, args.workers):
                name = f"r{rate}-w{workers}-{round_}"
                run = await one_run(fleet, workdir, name, workers, rate, stub_url, args)
                print(render([run], args).splitlines()[-1], flush=True)
                runs.append(run)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, nargs="+", default=[100_000], help="blocks/s during the flood")
    parser.add_argument("--seconds", type=float, default=15.0, help="the flood's length")
    parser.add_argument("--batch", type=int, default=2_000, help="blocks a batch")
    parser.add_argument("--rps", type=float, default=20.0, help="small requests a second")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds measured before the flood")
    parser.add_argument("--after", type=float, default=60.0, help="seconds to wait for every batch after it")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="-", help="markdown doc to write the block into ('-': print only)")
    parser.add_argument("--publish", help=argparse.SUPPRESS)  # the publisher child
    parser.add_argument("--go", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish:
        publish(args.publish, args.go, args.report, args.rate[0], args.seconds, args.batch)
        return 0
    generated_docs.started_tree()
    runs = asyncio.run(bench(args))
    body = render(runs, args)
    print(body)
    if args.out != "-":
        generated_docs.write_block(Path(args.out), generated_docs.measured(body))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
