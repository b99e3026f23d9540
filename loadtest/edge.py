"""Holding the edge: `kvgate serve` under a crowd of slow streams, a client that aborts, and slowloris.

Processes on loopback (127.0.0.1 only): two stub replicas that answer at an LLM's pace (this module's
``stubs`` command: ``tests.support.stub_backend``, one SSE chunk every ``--chunk-delay`` seconds, counting the
generations whose caller left), ``kvgate serve`` with its embedded Redis and one published adapter, and
the load generator here. Phases, in order:

a. **streams**: ``--waves`` waves of ``--streams`` concurrent streams of ``--chunks`` chunks (about
   8 s each): errors, and kvgate's RSS and open file descriptors before, at each wave's peak and after.
b. **aborts**: one client opens streams and closes each after its first event, ``--abort-rate`` a
   second for ``--abort-seconds``, while another client runs normal requests (``--workers`` at a
   time): the other client's errors, replicas seen unhealthy (``/kvgate/status`` every 0.1 s), retries
   (``/metrics``), duplicate upstream requests (each request has its own prompt; the stubs count them)
   and generations cancelled at the stubs.
c. **slowloris**: ``--slowloris`` connections each send a request line, then one header byte a second:
   how many kvgate closes within the header deadline (timed from each connection's connect), and normal
   requests meanwhile (errors, latency against the same client just before the attack).

Every client shares 127.0.0.1, so kvgate runs with ``--max-connections-per-client 0`` (the cap is per
address: here it would refuse the load generator itself); every other setting is its default. With
``--before DIR`` the same phases also run against the kvgate in DIR (e.g. ``git archive`` of an older
commit), side by side. The open files limit is raised to its hard limit (children inherit it).

Run from the repository root::

    .venv/bin/python -m loadtest.edge [--out docs/edge.md] [--before DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from gateway.dev import generated_docs
from gateway.process.http_edge import EDGE, EdgeLimits, free_port, raise_open_files_limit, running
from gateway.settings.model import Settings
from loadtest.proxy_overhead import (
    LOGICAL_ID,
    ROOT,
    Child,
    Fleet,
    _cpu_model,
    _load_average,
    _revision,
    _signals_exit,
    publish,
    stop_leftover_redis,
    wait_ready,
)
from tests.support.stub_backend import StubState, build_stub

TOKEN = "edge-loadtest-token"
HEADER_TIMEOUT = Settings.model_construct().header_timeout  # kvgate runs with the default
Results = dict[str, Any]


# --- the stub replicas (a child process) ------------------------------------------------------------


async def serve_stubs(ports: list[int], chunks: int, chunk_delay: float) -> None:
    """Stub replicas on ``ports`` until SIGTERM; no cap per client address (kvgate is their one client)."""
    limits = EdgeLimits.of(Settings.model_construct(max_connections_per_client=0))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        for port in ports:
            app = build_stub(StubState(chunks=chunks, chunk_delay=chunk_delay))
            app[EDGE] = limits
            await stack.enter_async_context(running(app, port=port))
        await stop.wait()


# --- observing kvgate -------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """kvgate's RSS and open descriptors every 0.1 s while a phase runs: peaks."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss_peak = rss_mb(pid)
        self.fds_peak = open_fds(pid)
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.rss_peak = max(self.rss_peak, rss_mb(self.pid))
                self.fds_peak = max(self.fds_peak, open_fds(self.pid))
            await asyncio.sleep(0.1)

    async def __aenter__(self) -> Sampler:
        self.task = asyncio.ensure_future(self.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def stub_counts(http: aiohttp.ClientSession, stubs: list[str]) -> Counter[str]:
    total: Counter[str] = Counter()
    for url in stubs:
        async with http.get(f"{url}/stub/stats") as response:
            total.update(await response.json())
    return total


async def metric(http: aiohttp.ClientSession, url: str, prefix: str) -> float:
    """The sum of ``/metrics`` samples whose line starts with ``prefix``."""
    async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


# --- clients ----------------------------------------------------------------------------------------


def body(stream: bool, prompt: str = "The quick brown fox") -> dict[str, Any]:
    return {"model": LOGICAL_ID, "prompt": prompt, "max_tokens": 32, "stream": stream}


async def one_stream(http: aiohttp.ClientSession, url: str, chunks: int) -> str:
    """``"ok"`` or what went wrong with one whole stream."""
    try:
        async with http.post(f"{url}/v1/completions", json=body(True)) as response:
            text = await response.text()
            if response.status != 200:
                return f"HTTP {response.status}: {text[:120]}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__
    complete = text.count("data: ") == chunks + 1 and text.rstrip().endswith("data: [DONE]")
    return "ok" if complete and '"error"' not in text else "broken stream"


async def one_request(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/completions", json=body(False, prompt)) as response:
            await response.read()
            outcome = "ok" if response.status == 200 else f"HTTP {response.status}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome = type(exc).__name__
    return outcome, time.perf_counter() - started


async def normal_traffic(
    url: str, workers: int, until: Callable[[], bool], name: str = "normal"
) -> list[tuple[str, float]]:
    """Non-streaming requests from ``workers`` loops until ``until()``; prompts ``{name}-{n}``, unique."""
    done: list[tuple[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=30)
    sent = iter(range(1 << 62))
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while not until():
                done.append(await one_request(http, url, f"{name}-{next(sent)}"))

        await asyncio.gather(*(worker() for _ in range(workers)))
    return done


def summarize_requests(done: list[tuple[str, float]]) -> Results:
    latencies = sorted(seconds for _, seconds in done)
    outcomes = Counter(outcome for outcome, _ in done)
    return {
        "requests": len(done),
        "errors": len(done) - outcomes["ok"],
        "outcomes": dict(outcomes),
        "p50_ms": statistics.median(latencies) * 1e3 if latencies else float("nan"),
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else float("nan"),
    }


# --- phases -----------------------------------------------------------------------------------------


async def phase_streams(url: str, kvgate: Child, stubs: list[str], args: argparse.Namespace) -> Results:
    """``--waves`` waves of ``--streams`` concurrent streams: a second wave shows whether memory grows."""
    pid = kvgate.process.pid
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession() as http:
        before = await stub_counts(http, stubs)
    rss_before, fds_before = rss_mb(pid), open_fds(pid)
    outcomes: Counter[str] = Counter()
    waves: list[Results] = []
    for _ in range(args.waves):
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            started = time.perf_counter()
            async with Sampler(pid) as sampler:
                wave = await asyncio.gather(
                    *(one_stream(http, url, args.chunks) for _ in range(args.streams))
                )
            wall = time.perf_counter() - started
        outcomes.update(wave)
        waves.append({"wall_s": wall, "rss_peak_mb": sampler.rss_peak, "fds_peak": sampler.fds_peak,
                      "rss_end_mb": rss_mb(pid)})  # fmt: skip
    await asyncio.sleep(3.0)  # the clients' connections are closed; kvgate keeps its upstream pool
    async with aiohttp.ClientSession() as http:
        after = await stub_counts(http, stubs)
    return {
        "streams": args.streams * args.waves,
        "errors": args.streams * args.waves - outcomes["ok"],
        "outcomes": dict(outcomes),
        "waves": waves,
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_mb(pid),
        "fds_before": fds_before,
        "fds_after": open_fds(pid),
        "upstream_requests": after["completions"] - before["completions"],
        "cancelled_upstream": after["cancelled"] - before["cancelled"],
    }


async def abort_once(http: aiohttp.ClientSession, url: str, prompt: str) -> str:
    try:
        response = await http.post(f"{url}/v1/completions", json=body(True, prompt))
        if response.status != 200:
            response.release()
            return f"HTTP {response.status}"
        await response.content.readuntil(b"\n\n")
        response.close()  # mid-stream: the connection goes
        return "aborted"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return type(exc).__name__


async def watch_health(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> tuple[int, int]:
    """Samples of ``/kvgate/status`` (every 0.1 s) and how many showed an unhealthy replica."""
    samples = unhealthy = 0
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(f"{url}/kvgate/status", headers={"x-kvgate-admin-token": TOKEN}) as response:
                replicas = (await response.json())["replicas"]
            samples += 1
            unhealthy += any(not replica["healthy"] for replica in replicas)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
    return samples, unhealthy


async def phase_aborts(url: str, stubs: list[str], args: argparse.Namespace) -> Results:
    retry = 'kvgate_routing_decisions_total{decision="retry"}'
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        before = await stub_counts(http, stubs)
        retries_before = await metric(http, url, retry)
        stop = asyncio.Event()
        watcher = asyncio.ensure_future(watch_health(http, url, stop))
        end = time.monotonic() + args.abort_seconds
        other = asyncio.ensure_future(
            normal_traffic(url, args.workers, lambda: time.monotonic() >= end, name="other")
        )
        aborts: list[asyncio.Future[str]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as aborter:
            while time.monotonic() < end:
                prompt = f"abort-{len(aborts)}"
                aborts.append(asyncio.ensure_future(abort_once(aborter, url, prompt)))
                await asyncio.sleep(1 / args.abort_rate)
            abort_outcomes = Counter(await asyncio.gather(*aborts))
        other_done = await other
        stop.set()
        samples, unhealthy = await watcher
        for _ in range(100):  # the stubs see the last aborted generations end
            after = await stub_counts(http, stubs)
            if after["cancelled"] - before["cancelled"] >= abort_outcomes["aborted"]:
                break
            await asyncio.sleep(0.1)
        retries = await metric(http, url, retry) - retries_before
        prompts: Counter[str] = Counter()
        for stub in stubs:
            async with http.get(f"{stub}/stub/prompts") as response:
                prompts.update(await response.json())
    ours = {prompt: n for prompt, n in prompts.items() if prompt.startswith(("abort-", "other-"))}
    return {
        "seconds": args.abort_seconds,
        "aborts": len(aborts),
        "abort_outcomes": dict(abort_outcomes),
        "other": summarize_requests(other_done),
        "health_samples": samples,
        "unhealthy_samples": unhealthy,
        "retries": retries,
        "upstream_requests": after["completions"] - before["completions"],
        "reached_replicas": len(ours),  # distinct requests of this phase that reached a replica
        "duplicates": sum(n - 1 for n in ours.values()),  # the same request sent to a replica again
        "cancelled_upstream": after["cancelled"] - before["cancelled"],
    }


@dataclass
class Slow:
    connected: float = 0.0
    closed: float | None = None  # when kvgate closed it (EOF or reset)
    answer: bytes = b""
    failed: str = ""  # could not connect

    @property
    def done(self) -> bool:
        return self.closed is not None or bool(self.failed)


async def slowloris_one(host: str, port: int, slow: Slow, stop: asyncio.Event) -> None:
    """A request line, then one header byte a second, until kvgate closes the connection (or ``stop``)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        slow.failed = type(exc).__name__
        return
    slow.connected = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nX-Slow: ")

        async def trickle() -> None:
            with contextlib.suppress(OSError):
                while not stop.is_set():
                    await asyncio.sleep(1.0)
                    writer.write(b"a")

        dripping = asyncio.ensure_future(trickle())
        reading = asyncio.ensure_future(reader.read())
        await asyncio.wait([reading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if reading.done() and not reading.cancelled() and reading.exception() is None:
            slow.answer = reading.result()
            slow.closed = time.monotonic()
        elif reading.done() and isinstance(reading.exception(), OSError):
            slow.closed = time.monotonic()  # reset by the server: closed too
        reading.cancel()
        dripping.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await asyncio.gather(reading, dripping)
    finally:
        writer.close()


async def phase_slowloris(url: str, kvgate: Child, args: argparse.Namespace) -> Results:
    host, port = "127.0.0.1", int(url.rsplit(":", 1)[1])
    baseline_end = time.monotonic() + 3.0
    baseline = await normal_traffic(url, args.workers, lambda: time.monotonic() >= baseline_end)
    stop = asyncio.Event()
    slows = [Slow() for _ in range(args.slowloris)]
    give_up = HEADER_TIMEOUT * 2 + 10.0
    async with Sampler(kvgate.process.pid) as sampler:
        started = time.monotonic()
        attack = [asyncio.ensure_future(slowloris_one(host, port, slow, stop)) for slow in slows]
        during_end = started + HEADER_TIMEOUT + 2.0
        during = await normal_traffic(url, args.workers, lambda: time.monotonic() >= during_end)
        await asyncio.wait(attack, timeout=max(0.0, started + give_up - time.monotonic()))
        stop.set()
        await asyncio.gather(*attack)
    held = sorted(s.closed - s.connected for s in slows if s.closed is not None)
    last_closed = max((s.closed for s in slows if s.closed is not None), default=None)
    return {
        "connections": args.slowloris,
        "connect_failed": sum(1 for s in slows if s.failed),
        "closed": len(held),
        "closed_in_deadline_1s": sum(1 for h in held if h <= HEADER_TIMEOUT + 1.0),
        "still_open_after_s": give_up,
        "still_open": sum(1 for s in slows if not s.done),
        "answered_408": sum(1 for s in slows if s.answer.startswith(b"HTTP/1.1 408")),
        "held_min_s": held[0] if held else float("nan"),
        "held_p50_s": statistics.median(held) if held else float("nan"),
        "held_p99_s": held[int(len(held) * 0.99)] if held else float("nan"),
        "held_max_s": held[-1] if held else float("nan"),
        "last_closed_after_start_s": last_closed - started if last_closed is not None else float("nan"),
        "fds_peak": sampler.fds_peak,
        "rss_peak_mb": sampler.rss_peak,
        "baseline": summarize_requests(baseline),
        "during": summarize_requests(during),
    }


# --- one kvgate, all phases -------------------------------------------------------------------------


async def run_all(url: str, kvgate: Child, stubs: list[str], args: argparse.Namespace) -> Results:
    results: Results = {}
    phases: list[tuple[str, Callable[[], Awaitable[Results]]]] = [
        ("streams", lambda: phase_streams(url, kvgate, stubs, args)),
        ("aborts", lambda: phase_aborts(url, stubs, args)),
        ("slowloris", lambda: phase_slowloris(url, kvgate, args)),
    ]
    for name, phase in phases:
        if name not in args.phases:
            continue
        print(f"  phase {name} ...", flush=True)
        results[name] = await phase()
        print("   ", json.dumps(results[name], default=str), flush=True)
        await asyncio.sleep(2.0)  # let kvgate settle between phases
    return results


BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from gateway.cli.main import main; sys.exit(main())"


def measure(workdir: Path, source: Path | None, args: argparse.Namespace) -> Results:
    """Stubs, publish, ``kvgate serve`` (this tree's, or the one in ``source``), the phases; all stopped."""
    py = sys.executable
    with Fleet(workdir) as fleet:
        fleet.callback(stop_leftover_redis, workdir)  # runs after kvgate has stopped
        ports = [free_port(), free_port()]
        stubs = [f"http://127.0.0.1:{port}" for port in ports]
        stub_argv = [py, "-m", "loadtest.edge", "stubs", "--chunks", str(args.chunks),
                     "--chunk-delay", str(args.chunk_delay), *(f"--port={p}" for p in ports)]  # fmt: skip
        stub = fleet.start("stubs", stub_argv)
        for url in stubs:
            wait_ready(stub, url + "/v1/models")
        publish(workdir)
        port = free_port()
        # --workers 1: its RSS and open descriptors are one process's
        common = ["serve", "--port", str(port), "--replica", stubs[0], "--replica", stubs[1],
                  "--data-dir", str(workdir / "kvgate"), "--store", str(workdir / "store"),
                  "--admin-token", TOKEN, "--workers", "1"]  # fmt: skip
        if source is None:
            argv = [py, "-m", "gateway.cli", *common, "--max-connections-per-client", "0"]
        else:
            argv = [py, "-c", BOOT, str(source), *common]
        kvgate = fleet.start("kvgate", argv)
        url = f"http://127.0.0.1:{port}"
        wait_ready(kvgate, url + "/healthz")
        return asyncio.run(run_all(url, kvgate, stubs, args))


# --- report -----------------------------------------------------------------------------------------


def _outcomes(found: dict[str, int]) -> str:
    bad = {k: v for k, v in found.items() if k not in ("ok", "aborted")}
    shown = (
        f"{v} x {k if len(k) < 90 else k[:90] + ' ...'}"
        for k, v in sorted(bad.items(), key=lambda kv: -kv[1])
    )
    return "; ".join(shown).replace("|", "\\|") or "none"


def _normal(summary: Results) -> str:
    return f"{summary['errors']} of {summary['requests']}, {summary['p50_ms']:.0f} / {summary['p99_ms']:.0f}"


def _slash(values: Sequence[float], digits: int = 0) -> str:
    return " / ".join(f"{value:.{digits}f}" for value in values)


def streams_rows(r: Results) -> list[tuple[str, str]]:
    waves = r["waves"]
    rss = [f"{r['rss_before_mb']:.0f}", *(f"{w['rss_peak_mb']:.0f}/{w['rss_end_mb']:.0f}" for w in waves),
           f"{r['rss_after_mb']:.0f}"]  # fmt: skip
    fds = [str(r["fds_before"]), *(str(w["fds_peak"]) for w in waves), str(r["fds_after"])]
    return [
        ("streams that failed", f"{r['errors']} of {r['streams']}"),
        ("what failed", _outcomes(r["outcomes"])),
        ("wall time of each wave (s)", ", ".join(f"{w['wall_s']:.1f}" for w in waves)),
        ("kvgate RSS (MB): before → each wave's peak/end → 3 s after", " → ".join(rss)),
        ("kvgate open fds: before → each wave's peak → 3 s after", " → ".join(fds)),
        ("requests at the stubs / generations cancelled there",
         f"{r['upstream_requests']} / {r['cancelled_upstream']}"),
    ]  # fmt: skip


def aborts_rows(r: Results) -> list[tuple[str, str]]:
    other = r["other"]
    return [
        ("streams aborted after their first event", str(r["abort_outcomes"].get("aborted", 0))),
        ("aborting client: requests refused", _outcomes(r["abort_outcomes"])),
        ("other client: requests failed", f"{other['errors']} of {other['requests']}"),
        ("other client: what failed", _outcomes(other["outcomes"])),
        ("`/kvgate/status` samples with an unhealthy replica",
         f"{r['unhealthy_samples']} of {r['health_samples']}"),
        ("retries on another replica", f"{r['retries']:.0f}"),
        ("requests of this phase that reached a replica", str(r["reached_replicas"])),
        ("duplicate upstream requests (one request at a replica again)", str(r["duplicates"])),
        ("generations cancelled at the stubs", str(r["cancelled_upstream"])),
    ]  # fmt: skip


def slowloris_rows(r: Results) -> list[tuple[str, str]]:
    return [
        ("connections closed by kvgate", f"{r['closed']} of {r['connections']}"),
        (f"... within the header deadline + 1 s ({HEADER_TIMEOUT + 1:g} s)", str(r["closed_in_deadline_1s"])),
        ("... answered 408 before closing", str(r["answered_408"])),
        ("still open when the generator gave up", f"{r['still_open']} (after {r['still_open_after_s']:g} s)"),
        ("held open, from connect as the generator saw it: min / p50 / p99 / max (s)",
         _slash([r["held_min_s"], r["held_p50_s"], r["held_p99_s"], r["held_max_s"]], 1)),
        ("last one closed, from the attack's start (s)", f"{r['last_closed_after_start_s']:.1f}"),
        ("kvgate open fds / RSS (MB), peak", f"{r['fds_peak']} / {r['rss_peak_mb']:.0f}"),
        ("normal requests just before: failed, p50 / p99 ms", _normal(r["baseline"])),
        ("normal requests during: failed, p50 / p99 ms", _normal(r["during"])),
    ]  # fmt: skip


def table(
    runs: dict[str, Results], phase: str, rows: Callable[[Results], list[tuple[str, str]]]
) -> list[str]:
    columns = {name: rows(run[phase]) for name, run in runs.items() if phase in run}
    labels = [label for label, _ in next(iter(columns.values()))]
    lines = ["| | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 1)]
    for i, label in enumerate(labels):
        lines.append(f"| {label} | " + " | ".join(cells[i][1] for cells in columns.values()) + " |")
    return [*lines, ""]


def render(runs: dict[str, Results], args: argparse.Namespace, env: dict[str, str]) -> str:
    seconds = args.chunk_delay * args.chunks
    lines = [
        "# Holding the edge: streams, aborting clients, slowloris",
        "",
        f"Measured {env['date']} by `make loadtest-edge`, exactly:",
        "",
        f"    {env['command']}",
        "",
        f"Two stub replicas in one process (an SSE chunk every {args.chunk_delay:g} s, {args.chunks} chunks: "
        f"about {seconds:g} s a",
        "stream), `kvgate serve` with its embedded Redis and one published adapter (requests name its",
        "logical ID), and the load generator, each its own process on 127.0.0.1. kvgate runs with its",
        "default settings except `--max-connections-per-client 0` (every client here has one address).",
        "",
    ]
    if "streams" in args.phases:
        lines += [f"## a. {args.streams} concurrent streams of about {seconds:g} s, {args.waves} waves", ""]
        lines += table(runs, "streams", streams_rows)
    if "aborts" in args.phases:
        rate, span = f"{args.abort_rate:g}", f"{args.abort_seconds:g}"
        lines += [f"## b. A client aborting {rate} streams a second for {span} s beside a client with "
                  f"{args.workers} workers of normal requests", ""]  # fmt: skip
        lines += table(runs, "aborts", aborts_rows)
    if "slowloris" in args.phases:
        lines += [f"## c. Slowloris: {args.slowloris} connections sending headers a byte a second "
                  f"(header deadline {HEADER_TIMEOUT:g} s)", ""]  # fmt: skip
        lines += table(runs, "slowloris", slowloris_rows)
    if args.before is not None:
        lines += [f"`{args.before_label}` is kvgate from `{args.before}`, run beside this tree's (an",
                  "export of that commit, e.g. `git archive <commit> | tar -x -C DIR`); `make loadtest-edge`",
                  "measures this tree alone.", ""]  # fmt: skip
    lines += [*NOTES, ""]
    lines += [
        f"Machine: {env['machine']}. Tree measured: {env['revision']}. Load average at start / end:",
        f"{env['load_start']} / {env['load_end']}. One run on a shared machine: read the latencies as orders",
        "of magnitude and the counts as the result.",
        "",
    ]
    return "\n".join(lines)


NOTES = """\
## Reading it

- **a. Streams.** kvgate used to keep aiohttp's hidden limit of 256 connections per replica, and the
  wait for a pooled connection counted against the 5 s connect timeout, so streams beyond 256 per
  replica failed as 504 "replica ... timed out" (blaming the replica). kvgate now owns the limit:
  `max_connections_per_replica` (default 2048, 0 = none) with its own wait, `pool_wait_timeout`
  (default 10 s), and its own error, 503 `replica_busy`, saying how long it waited; the connect
  timeout measures connecting only. RSS stays flat from one wave to the next. The open descriptors
  left after the waves are kvgate's idle connections to the replicas (one per stream of the last
  wave), which its client to the replicas keeps for reuse and closes once idle for 2 s
  (`gateway/request/upstream.py`).
- **b. Aborting client.** A write to a client that had left raised `ClientConnectionResetError`, an
  `aiohttp.ClientError`, which kvgate took for the replica failing: it marked the replica unhealthy
  (both, soon: "no healthy replica" for everyone else) and sent the request again to the other one.
  Now a failed write to the client is `ClientClosed`: kvgate closes the upstream response (the replica
  stops generating; the stubs count it), counts the request as outcome `client_closed`, and neither
  marks nor retries. A client that leaves a pending non-streaming request cancels it upstream too
  (aiohttp's `handler_cancellation`).
- **c. Slowloris.** aiohttp has no header deadline: a connection that sends its headers slowly was held
  for its keep-alive timeout (3,630 s by default). kvgate's `header_timeout` (default 10 s) runs from
  the connection's accept (or a kept-alive request's first byte) and answers 408 with an OpenAI body,
  then closes. "Held open" is timed from when the generator's own event loop saw each connect complete,
  which lags behind the accept with 3,000 connects at once (hence under 10 s); the last close, from the
  attack's start, bounds it from the other side. After the 408 and end of stream, kvgate drops a
  timed-out connection's input for a second before closing the socket: closing on a client that is still
  sending makes the kernel reset the connection, which can destroy the unread 408 (an earlier version
  did that to 15% of them). The per-address cap is off in this run (every client is 127.0.0.1); with it
  on, connections over the cap get a 429 to their request, and a slowloris one, which never completes a
  request, is closed at the header deadline like the rest.

Deadlines and limits, all settings ([configuration.md](configuration.md)): `header_timeout` 10 s,
`body_timeout` 60 s (the whole body, once the headers are in; 408), `keepalive_timeout` 60 s (idle
between requests), `max_connections_per_client` 1024 (429, then closed), `max_connections_per_replica`
2048 and `pool_wait_timeout` 10 s (503 `replica_busy`).""".splitlines()


# --- main -------------------------------------------------------------------------------------------

PHASES = ("streams", "aborts", "slowloris")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.edge", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    stubs = commands.add_parser("stubs", help="(internal) run stub replicas until SIGTERM")
    stubs.add_argument("--port", type=int, action="append", required=True)
    stubs.add_argument("--chunks", type=int, required=True)
    stubs.add_argument("--chunk-delay", type=float, required=True)
    parser.add_argument("--streams", type=int, default=1000, help="phase a: concurrent streams (1000)")
    parser.add_argument(
        "--waves", type=int, default=2, help="phase a: waves of streams, one after another (2)"
    )
    parser.add_argument("--chunks", type=int, default=32, help="SSE chunks per stream (32)")
    parser.add_argument("--chunk-delay", type=float, default=0.25, help="seconds between chunks (0.25)")
    parser.add_argument("--abort-rate", type=float, default=20.0, help="phase b: aborts a second (20)")
    parser.add_argument("--abort-seconds", type=float, default=8.0, help="phase b: seconds (8)")
    parser.add_argument("--workers", type=int, default=4, help="normal requests in flight (4)")
    parser.add_argument("--slowloris", type=int, default=3000, help="phase c: connections (3000)")
    parser.add_argument(
        "--phases", default=",".join(PHASES), help="comma-separated subset of " + ", ".join(PHASES)
    )
    parser.add_argument(
        "--before", type=Path, metavar="DIR", help="also measure the kvgate source tree in DIR"
    )
    parser.add_argument("--before-label", default="before", help="its column's name")
    parser.add_argument("--out", default="docs/edge.md", help="markdown report ('-': print only)")
    args = parser.parse_args(argv)
    args.phases = tuple(p for p in PHASES if p in args.phases.split(","))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    generated_docs.started_tree()  # the tree measured, taken before the run
    if args.command == "stubs":
        asyncio.run(serve_stubs(args.port, args.chunks, args.chunk_delay))
        return 0
    limit = raise_open_files_limit()  # for the generator's connections; children inherit it
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([python, "-m", "loadtest.edge", *raw]),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}, open files limit {limit}",
        "load_start": _load_average(),
        "revision": _revision(),
    }
    runs: dict[str, Results] = {}
    with _signals_exit():
        targets: list[tuple[str, Path | None]] = [("this tree", None)]
        if args.before is not None:
            targets.insert(0, (args.before_label, args.before.resolve()))
        for label, source in targets:
            print(f"kvgate: {label}", flush=True)
            with tempfile.TemporaryDirectory(prefix="kvgate-edge-") as tmp:
                runs[label] = measure(Path(tmp), source, args)
    env["load_end"] = _load_average()
    report = render(runs, args, env)
    print(report)
    if args.out != "-":
        generated_docs.write_report(Path(args.out), report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
