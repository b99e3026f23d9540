"""The epoch table at scale: N simulated kvgates (the real SnapshotSync) on one real redis-server.

A redis-server of its own (TCP, no persistence) gets IDS logical IDs with 3 published versions each
(through the real publish script). For each N in --kvgates, N simulated kvgates start in a few processes
(loadtest/scale_worker.py: asyncio tasks, each with its own client and snapshot), each reads the table
(cold start), then Redis is watched for --window seconds with no changes and --window seconds with
--rate publishes a second (random IDs, the next of their 3 versions). Measured: Redis commands/s (INFO
commandstats deltas: commands run inside scripts count too), Redis CPU (INFO cpu deltas, % of one core),
publish -> all N snapshots hold it (p50/p99, wall clock, one machine), cold-start full read time, and
one snapshot's memory (tracemalloc) plus the RSS growth per kvgate. --old-kvgates repeats it with the
old full-reconcile path (re-implemented in scale_worker.py, as of f4d700f) for comparison. Before the
scenarios, loadtest/scale_cold.py measures cold starts side by side (--cold-kvgates processes at once,
--cold-rounds times): a full read of the table against the snapshot file and the change log.

    .venv/bin/python -m loadtest.scale --ids 100000 --kvgates 1 10 100 --old-kvgates 1 \\
        --out docs/scale.md --plot docs/scale.png

--out writes the figures into their generated block of docs/scale.md (gateway/dev/generated_docs.py): the
command, date, tree and load, the machine, the table and the targets, all from this run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from loadtest import scale_cold

VERSIONS = 3
PER_PROCESS = 25  # simulated kvgates per worker process


def digest(logical_id: str, version: int) -> str:
    return hashlib.blake2b(f"{logical_id}/{version}".encode(), digest_size=32).hexdigest()


async def populate(table: EpochTable, ids: int, batch: int = 2_000) -> None:
    """IDS logical IDs, each published VERSIONS times (epoch 3, three versions), with the real script."""
    await table.ensure_generation()
    names = [f"tenant-{i:07d}" for i in range(ids)]
    for start in range(0, ids, batch):
        chunk = names[start : start + batch]
        async with table.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(keys.IDS, *chunk)
            for version in range(VERSIONS):
                for logical_id in chunk:
                    d = digest(logical_id, version)
                    script, table_keys, args = table.scripts.publish_version_call(
                        logical_id, d, f"{logical_id}@{d[:16]}", f"/store/{d}", "base", "", now=table.clock()
                    )
                    pipe.evalsha(script.sha, len(table_keys), *table_keys, *args)
            await table.redis.script_load(script.script)  # EVALSHA in a pipeline: the script loaded first
            await pipe.execute()


@dataclass
class Result:
    path: str
    kvgates: int
    ids: int
    rate: float
    cold_start_s: list[float] = field(default_factory=list)
    tracemalloc_mb: float = 0.0
    rss_mb_per_kvgate: float = 0.0
    idle: Window | None = None  # no changes
    busy: Window | None = None  # --rate changes a second
    converge_ms: list[float] = field(default_factory=list)
    unconverged: int = 0
    full_reads: dict[str, int] = field(default_factory=dict)


PUBLISHER_EVALSHAS = 2  # a publish is two scripts: ensure_generation, publish_version
ISSUED = ("cmdstat_evalsha", "cmdstat_xread", "cmdstat_xinfo|stream")
"""What a following kvgate sends itself once it has read the table (heartbeat EVALSHA, XREAD BLOCK, XINFO
after a batch); every other command in commandstats ran inside a script (the scrub's HMGET and HGET, a
publish's writes), or was sent by the publisher (with changes: an HGETALL and an EVALSHA per publish),
or by the old path (SMEMBERS, HGETALL per ID, GET)."""


async def stats(redis: Redis) -> tuple[dict[str, int], float]:
    commands = await redis.info("commandstats")
    cpu = await redis.info("cpu")
    calls = {name: int(value["calls"]) for name, value in commands.items() if name != "cmdstat_info"}
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


@dataclass
class Window:
    commands: float  # every command Redis ran a second (commandstats, those inside scripts too)
    issued: float  # of them, sent by clients (ISSUED), a second; with changes the publisher's count too
    inner: float  # run inside scripts, a second (with the outer ones from clients not in ISSUED: none idle)
    cpu: float  # % of one core


async def watch(redis: Redis, seconds: float, work: Any = None) -> Window:
    """What Redis did over SECONDS (while WORK runs, if any)."""
    calls0, cpu0 = await stats(redis)
    started = time.monotonic()
    if work is None:
        await asyncio.sleep(seconds)
    else:
        await work
    elapsed = time.monotonic() - started
    calls1, cpu1 = await stats(redis)
    delta = {name: n - calls0.get(name, 0) for name, n in calls1.items()}
    total = sum(delta.values())
    issued = sum(delta.get(name, 0) for name in ISSUED)
    return Window(
        total / elapsed, issued / elapsed, (total - issued) / elapsed, 100 * (cpu1 - cpu0) / elapsed
    )


async def changes(table: EpochTable, ids: int, rate: float, seconds: float) -> list[tuple[str, int, float]]:
    """RATE publishes a second for SECONDS: (logical ID, epoch, wall time the publish returned)."""
    done: list[tuple[str, int, float]] = []
    rng = random.Random(7)
    start = time.monotonic()
    for n in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        logical_id = f"tenant-{rng.randrange(ids):07d}"
        state = await table.read_state(logical_id)
        assert state is not None
        version = (state.epoch) % VERSIONS  # epoch e holds version (e - 1) % 3: publish the next one
        d = digest(logical_id, version)
        change = await table.publish(logical_id, d, f"{logical_id}@{d[:16]}", f"/store/{d}", "base")
        done.append((logical_id, change.epoch, time.time()))
    return done


async def scenario(
    url: str, redis: Redis, path: str, kvgates: int, ids: int, args: argparse.Namespace
) -> Result:
    result = Result(path, kvgates, ids, args.rate)
    sizes = [min(PER_PROCESS, kvgates - i) for i in range(0, kvgates, PER_PROCESS)]
    workers = []
    for i, size in enumerate(sizes):
        argv = [
            sys.executable,
            "-m",
            "loadtest.scale_worker",
            "--url",
            url,
            "--kvgates",
            str(size),
            "--path",
            path,
        ]
        argv += ["--memory"] if i == 0 else []
        workers.append(
            await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 30
            )
        )
    readies = [json.loads(await worker.stdout.readline()) for worker in workers]  # type: ignore[union-attr]
    for ready in readies:
        result.cold_start_s += ready["cold_start_s"]
    result.tracemalloc_mb = readies[0]["tracemalloc_bytes"] / 2**20
    result.rss_mb_per_kvgate = statistics.mean(r["rss_delta_kb_per_kvgate"] for r in readies) / 1024
    await asyncio.sleep(args.settle)
    result.idle = await watch(redis, args.window)
    table = EpochTable(redis)
    publishing = asyncio.ensure_future(changes(table, ids, args.rate, args.window))
    result.busy = await watch(redis, args.window, publishing)
    published = publishing.result()
    await asyncio.sleep(args.settle)  # the last changes arrive
    seen: dict[tuple[str, int], list[float]] = {}
    for worker in workers:
        worker.stdin.write(b"stop\n")  # type: ignore[union-attr]
        await worker.stdin.drain()  # type: ignore[union-attr]
        report = json.loads(await worker.stdout.readline())  # type: ignore[union-attr]
        for kvgate_seen in report["seen"]:
            for logical_id, epoch, at in kvgate_seen:
                seen.setdefault((logical_id, epoch), []).append(at)
        for counts in report["full_reads"]:
            for reason, n in counts.items():
                result.full_reads[reason] = result.full_reads.get(reason, 0) + n
        await worker.wait()
    for logical_id, epoch, at in published:
        times = seen.get((logical_id, epoch), [])
        if len(times) < kvgates:
            result.unconverged += 1
        else:
            result.converge_ms.append(1000 * (max(times) - at))
    return result


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(r: Result) -> str:
    assert r.idle is not None
    assert r.busy is not None
    cold = statistics.median(r.cold_start_s)
    publisher = PUBLISHER_EVALSHAS * r.rate  # the publisher's own EVALSHAs are not a kvgate's
    sent_idle, sent_busy = (
        (r.idle.issued, r.busy.issued - publisher) if r.path == "new" else (r.idle.commands, r.busy.commands)
    )
    return (
        f"| {r.path} | {r.kvgates} | {r.ids:,} | {r.idle.commands:,.0f} | {sent_idle / r.kvgates:,.2f} | "
        f"{r.idle.cpu:.1f} | {r.busy.commands:,.0f} | {sent_busy / r.kvgates:,.2f} | {r.busy.cpu:.1f} | "
        f"{pct(r.converge_ms, 0.5):.1f} | {pct(r.converge_ms, 0.99):.1f} | {r.unconverged} | {cold:.2f} | "
        f"{max(r.cold_start_s):.2f} | {r.tracemalloc_mb:.1f} | {r.full_reads} |"
    )


HEADER = (
    "| path | kvgates | IDs | idle: Redis cmd/s (all) | idle: sent cmd/s per kvgate | idle: Redis CPU % | "
    "10/s: Redis cmd/s (all) | 10/s: sent cmd/s per kvgate | 10/s: Redis CPU % | converged p50 ms | "
    "p99 ms | not converged | cold start s (median) | (slowest) | snapshot MB | full reads |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def sent_idle(r: Result) -> float:
    assert r.idle is not None
    return (r.idle.issued if r.path == "new" else r.idle.commands) / r.kvgates


def targets(results: list[Result], cold_rows: list[tuple[str, str, bool]]) -> str:
    """The issue's targets against this run's new-path rows (benchmarks, not timed tests)."""
    new = [r for r in results if r.path == "new"]
    if not new:
        return _target_table(cold_rows)
    largest = max(new, key=lambda r: (r.kvgates, r.ids))
    one = min(new, key=lambda r: (r.kvgates, -r.ids))
    idle = [sent_idle(r) for r in new]
    fleets = ", ".join(str(r.kvgates) for r in new)
    p99 = pct(largest.converge_ms, 0.99)
    cpu = largest.busy.cpu if largest.busy is not None else float("nan")
    cold = statistics.median(one.cold_start_s)
    memory = max(r.tracemalloc_mb for r in new)
    at = f"N = {largest.kvgates}, {largest.ids:,} IDs"
    rows = [
        ("steady state, no changes: commands a kvgate sends per second <= 2, whatever the number of IDs",
         f"{min(idle):.2f} to {max(idle):.2f} (N = {fleets})", max(idle) <= 2),
        ("100,000 IDs, 100 kvgates, 10 changes/s: publish -> all converged p99 <= 100 ms",
         f"{p99:,.1f} ms ({at})", p99 <= 100),
        ("same: Redis CPU <= 10 % of a core", f"{cpu:.1f} % ({at})", cpu <= 10),
        ("cold start: a full read of 100,000 IDs <= 2 s",
         f"{cold:.2f} s (N = {one.kvgates}, {one.ids:,} IDs)", cold <= 2),
        ("snapshot memory <= 100 MB per kvgate", f"{memory:.1f} MB ({max(r.ids for r in new):,} IDs)",
         memory <= 100),
    ]  # fmt: skip
    return _target_table(rows + cold_rows)


def _target_table(rows: list[tuple[str, str, bool]]) -> str:
    lines = ["| target | measured | met at the size run? |", "|---|---|---|"]
    lines += [f"| {target} | {value} | {'yes' if met else 'no'} |" for target, value, met in rows]
    return "\n".join(lines)


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(
    results: list[Result],
    populated_s: float,
    memory_mb: float,
    load_start: str,
    args: argparse.Namespace,
    cold: dict[str, Any] | None,
) -> str:
    ids = args.ids
    table = "\n".join([HEADER, *(row(r) for r in results)])
    cold_table = scale_cold.table(cold, ids, args.cold_rounds) + "\n\n" if cold else ""
    cold_rows = scale_cold.target_rows(cold, ids) if cold else []
    return f"""Machine: {machine()}; load average at the start {load_start} (other work shares it: wall-clock
figures, cold start and convergence, include waiting for a core; command counts and Redis CPU less so).
One run of each scenario. Populating {ids:,} IDs x {VERSIONS} versions took {populated_s:.0f} s; Redis
`used_memory` with the table: {memory_mb:.0f} MB.

{table}

{cold_table}Targets (from the issues), against this run's new-path rows and cold starts:

{targets(results, cold_rows)}

![Redis commands and CPU against the number of kvgates](scale.png)"""


def plot(results: list[Result], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path, marker in (("new", "o"), ("old", "s")):
        mine = [r for r in results if r.path == path]
        if mine:
            n = [r.kvgates for r in mine]
            for axis, measure in ((left, "commands"), (right, "cpu")):
                idle = [getattr(r.idle, measure) for r in mine]
                busy = [getattr(r.busy, measure) for r in mine]
                axis.plot(n, idle, marker=marker, label=f"{path}: no changes")
                axis.plot(n, busy, marker=marker, linestyle="--", label=f"{path}: 10 changes/s")
    for axis, label in (
        (left, "Redis commands/s (incl. inside scripts)"),
        (right, "Redis CPU, % of one core"),
    ):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("simulated kvgates")
        axis.set_ylabel(label)
        axis.legend(fontsize=7)
    fig.suptitle(f"epoch table, {results[0].ids:,} IDs x {VERSIONS} versions")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


async def main(args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="kvgate-scale-"))
    port = free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything runs)
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(home), "--maxclients", "10000"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}"
    redis = Redis.from_url(url, socket_timeout=60.0)
    try:
        while True:
            try:
                await redis.ping()
                break
            except Exception:
                await asyncio.sleep(0.1)
        load_start = generated_docs.load()
        started = time.monotonic()
        await populate(EpochTable(redis), args.ids)
        populated_s = time.monotonic() - started
        print(f"populated {args.ids:,} IDs x {VERSIONS} in {populated_s:.0f} s", flush=True)
        cold = await scale_cold.run(url, redis, args, home, digest) if args.cold_rounds else None
        results: list[Result] = []
        for path, fleet in (("new", args.kvgates), ("old", args.old_kvgates)):
            for n in fleet:
                result = await scenario(url, redis, path, n, args.ids, args)
                print(HEADER.splitlines()[0] if not results else "", row(result), sep="\n", flush=True)
                results.append(result)
        memory = (await redis.info("memory"))["used_memory"] / 2**20
        text = report(results, populated_s, memory, load_start, args, cold)
        print(text)
        if args.out:
            generated_docs.write_block(args.out, generated_docs.measured(text))
        if args.plot:
            plot(results, args.plot)
    finally:
        await redis.aclose()
        server.terminate()
        server.wait()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--ids", type=int, default=100_000)
    parser.add_argument("--kvgates", type=int, nargs="*", default=[1, 10, 100])
    parser.add_argument("--old-kvgates", type=int, nargs="*", default=[1])
    parser.add_argument("--rate", type=float, default=10.0, help="publishes a second in the busy window")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured, per phase")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the cold start, and after")
    parser.add_argument("--cold-kvgates", type=int, nargs="*", default=[1, 10], help="started at once")
    parser.add_argument("--cold-rounds", type=int, default=3, help="cold starts per mode (0: none)")
    parser.add_argument("--cold-changes", type=int, default=50, help="new IDs published after the file")
    parser.add_argument("--out", type=Path, help="the doc whose generated block gets the figures")
    parser.add_argument("--plot", type=Path, help="a PNG plot")
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    asyncio.run(main(args))
