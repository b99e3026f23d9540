"""What a worker costs: ``kvgate serve --workers N`` started and left idle, for N = 1 and 2 (docs/workers.md).

Each start is ``kvgate serve`` in front of the stub (``loadtest/stub_server.py``), its embedded Redis, a
fresh data directory (so every worker reads the table in full: no snapshot file yet), the counts taken in
turn (1, 2, 1, 2, ...). Measured for each start:

- **start to ready**: from the process's start to ``/healthz`` 200, which with workers means every worker
  is ready (docs/workers.md);
- **RSS per kvgate process**: ``VmRSS`` of the parent and each worker from /proc (the redis-server child
  left out);
- **Redis commands/s at idle**: ``total_commands_processed`` of the embedded Redis across ``--idle``
  seconds with no request (heartbeats, change-log reads, replica polls, leases);
- **kvgate's CPU at idle**: its process tree's (Redis included) across the same window, in cores;
- **foreign load**: the machine's busy CPU (/proc/stat) across the window minus kvgate's and the stub's, in
  cores: the other work on a shared machine, which inflates start times.

Run from the repository root (``make loadtest-workers``; a few minutes)::

    .venv/bin/python -m loadtest.workers_cost [--starts 3] [--idle 10] [--out docs/workers.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.proxy_overhead import (
    ROOT,
    Child,
    Fleet,
    machine_busy,
    process_tree,
    stop_leftover_redis,
    wait_ready,
)

COUNTS = (1, 2)


@dataclass(frozen=True)
class Start:
    workers: int
    ready_s: float
    rss_mb: list[float]  # one per kvgate process (parent and workers; one process with --workers 1)
    commands_per_s: float
    idle_cores: float
    foreign_cores: float


def _status_kb(pid: int, field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    return None


def kvgate_rss_mb(root: int) -> list[float]:
    """VmRSS of each process in ``root``'s tree but the embedded redis-server, in MB."""
    rss = []
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("redis"):
                continue
            if (kb := _status_kb(pid, "VmRSS")) is not None:
                rss.append(kb / 1024)
    return rss


def commands_processed(client: redis.Redis) -> int:
    return int(client.info("stats")["total_commands_processed"])


def counters(client: redis.Redis, serve: Child, stub: Child) -> tuple[int, float, float, float]:
    """Redis's command count, the machine's busy CPU, kvgate's tree's and the stub's CPU (seconds)."""
    return commands_processed(client), machine_busy(), serve.cpu_seconds(), stub.cpu_seconds()


def one_start(
    fleet: Fleet, workdir: Path, name: str, workers: int, stub: Child, stub_url: str, idle: int
) -> Start:
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url,
            "--data-dir", str(workdir / name), "--store", str(workdir / "store"),
            "--workers", str(workers), "--port", str(port)]  # fmt: skip
    started = time.monotonic()
    serve = fleet.start(name, argv)
    try:
        wait_ready(serve, f"http://127.0.0.1:{port}/healthz", timeout=180.0)
        ready = time.monotonic() - started
        rss = kvgate_rss_mb(serve.process.pid)
        client = redis.Redis(
            unix_socket_path=str(workdir / name / "redis" / "redis.sock"), socket_timeout=5.0
        )
        try:
            commands0, busy0, own0, stub0 = counters(client, serve, stub)
            wall0 = time.monotonic()
            time.sleep(idle)  # the window measured: nothing is sent to kvgate meanwhile
            wall = time.monotonic() - wall0
            commands1, busy1, own1, stub1 = counters(client, serve, stub)
        finally:
            client.close()
    finally:
        serve.stop()
        stop_leftover_redis(workdir, name)
    own = own1 - own0
    return Start(
        workers=workers,
        ready_s=ready,
        rss_mb=rss,
        commands_per_s=(commands1 - commands0 - 1) / wall,  # the second INFO is not kvgate's
        idle_cores=own / wall,
        foreign_cores=max(busy1 - busy0 - own - (stub1 - stub0), 0.0) / wall,
    )  # fmt: skip


def _cell(values: Sequence[float], fmt: str, unit: str = "") -> str:
    median = fmt.format(statistics.median(values))
    if len(values) < 2:
        return f"{median}{unit}"
    return f"{median}{unit} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def render(starts: list[Start], counts: Sequence[int], idle: int) -> str:
    of = {n: [s for s in starts if s.workers == n] for n in counts}
    runs = len(of[counts[0]])
    head = " | ".join(f"`--workers {n}`" for n in counts)
    lines = [
        f"Median over {runs} starts of each (min-max), the counts in turn, each start in a fresh data "
        f"directory; the idle window {idle} s right after ready. "
        f"{len(os.sched_getaffinity(0))} cores available.",
        "",
        f"| | {head} |",
        "| --- |" + " ---: |" * len(counts),
    ]

    def row(label: str, cell: Callable[[list[Start]], object]) -> None:
        lines.append(f"| {label} | " + " | ".join(str(cell(of[n])) for n in counts) + " |")

    row(
        "start to ready (`/healthz` 200: every worker ready)",
        lambda g: _cell([s.ready_s for s in g], "{:.1f}", " s"),
    )
    row("kvgate processes (parent and workers)", lambda g: statistics.median(len(s.rss_mb) for s in g))
    row("RSS per kvgate process", lambda g: _cell([r for s in g for r in s.rss_mb], "{:.0f}", " MB"))
    row(
        "Redis commands/s at idle (heartbeats, change-log reads, polls)",
        lambda g: _cell([s.commands_per_s for s in g], "{:.0f}"),
    )
    row(
        "kvgate's CPU at idle (its tree, Redis included)",
        lambda g: _cell([s.idle_cores for s in g], "{:.3f}", " cores"),
    )
    row(
        "foreign load during the idle window",
        lambda g: _cell([s.foreign_cores for s in g], "{:.2f}", " cores"),
    )
    if len(counts) >= 2:
        first, last = counts[0], counts[-1]
        pairs = list(zip(of[first], of[last], strict=True))
        ratio = statistics.median(b.ready_s / a.ready_s for a, b in pairs)
        more = statistics.median(b.commands_per_s - a.commands_per_s for a, b in pairs)
        lines += [
            "",
            f"`--workers {last}` against `--workers {first}`, start by start: start to ready x{ratio:.1f} "
            f"(median of the ratios), {more:+.0f} Redis commands/s at idle.",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each worker count")
    parser.add_argument("--idle", type=int, default=10, help="seconds of the idle window after ready")
    parser.add_argument("--counts", type=int, nargs="+", default=list(COUNTS), help="worker counts")
    parser.add_argument("--out", default="-", help="markdown doc to write the block into ('-': print only)")
    args = parser.parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-workers-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        stub_port = free_port()
        stub = fleet.start("stub", [sys.executable, "-m", "loadtest.stub_server", "--port", str(stub_port)])
        stub_url = f"http://127.0.0.1:{stub_port}"
        wait_ready(stub, stub_url + "/v1/models")
        for round_ in range(args.starts):
            for workers in args.counts:
                start = one_start(fleet, workdir, f"w{workers}-{round_}", workers, stub, stub_url, args.idle)
                starts.append(start)
                print(f"--workers {workers}: ready in {start.ready_s:.1f} s, RSS "
                      f"{', '.join(f'{r:.0f}' for r in start.rss_mb)} MB, {start.commands_per_s:.0f} Redis "
                      f"commands/s idle, foreign {start.foreign_cores:.2f} cores", flush=True)  # fmt: skip
    report = render(starts, args.counts, args.idle)
    print(report)
    if args.out != "-":
        generated_docs.write_block(ROOT / args.out, generated_docs.measured(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
