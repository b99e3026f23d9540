"""Proxy CPU cost, side by side: kvgate, a naive aiohttp proxy, nginx and vllm-router, same stub behind.

Every server runs in its own process on loopback: the vLLM-API stub (``tests.stub_backend``, 32 SSE
chunks per stream), ``kvgate serve`` (an adapter published through ``kvgate publish``, embedded Redis),
the naive proxy (``loadtest/naive_proxy.py``), nginx with ``proxy_pass`` when ``nginx`` is on PATH, and
vllm-router (Rust, ``round_robin`` over the one stub) when its command exists (``--vllm-router``, default
``.venv-router/bin/vllm-router``; ``make loadtest-proxy`` installs it there). Missing ones are reported.
The load generator runs here (aiohttp, keep-alive, fixed concurrency, bounded in count and time).

What is measured is CPU time, not throughput: utime+stime of the proxy process (``/proc/<pid>/stat``
deltas, nginx master and workers summed) over a phase, divided by the requests in it. The machine is
shared and noisy, so each figure is the median over rounds, and ratios are taken within each round (same
conditions) before their median. The direct target has no proxy; the stub's own CPU per request is shown
for every target as context.

Run from the repository root::

    .venv/bin/python -m loadtest.proxy_overhead [--requests N] [--rounds R] [--out docs/perf.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import aiohttp

from gateway import generated_docs
from gateway.serving import free_port
from loadtest.hotspots import summarize, summarize_pstats

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOGICAL_ID = "bench"
CHUNKS = 32
TARGET_US = {"plain": 250.0, "stream": 600.0}
# Quoted by the team for this machine; NOT measured by this script (its own figures for the same proxies
# are in the table it writes, next to these).
REFERENCE_US = {
    "nginx proxy_pass": (60, 400),
    "vllm-router (Rust)": (200, 850),
    "naive aiohttp proxy": (500, 1100),
}
KINDS = ("plain", "stream")


# --- child processes ------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the benchmark dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    group: bool = False  # nginx: count the master's children (workers) too

    def pids(self) -> list[int]:
        if not self.group:
            return [self.process.pid]
        return [self.process.pid, *_children_of(self.process.pid)]

    def cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the process (nginx: master and workers)."""
        times = [_cpu_times(pid) for pid in self.pids()]
        return sum(u for u, _ in times), sum(s for _, s in times)

    def cpu_seconds(self) -> float:
        return sum(self.cpu_times())

    def tail(self, limit: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                self.process.wait()


def _cpu_times(pid: int) -> tuple[float, float]:
    """(utime, stime) of a whole process (all threads), from /proc/<pid>/stat; zeros if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    fields = stat.rpartition(")")[2].split()  # fields[0] is field 3 (state)
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


class Fleet(contextlib.ExitStack):
    """Every child started here; all of them stop on exit, in reverse order, whatever happened."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: Sequence[str], *, group: bool = False) -> Child:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # no threads exist yet
            )
        child = Child(name, process, log, group)
        self.children[name] = child
        self.callback(child.stop)
        return child


def wait_ready(child: Child, url: str, *, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.process.returncode}):\n{child.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as answer:
                if answer.status == 200:
                    return
                last = f"HTTP {answer.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{child.name} not ready at {url} after {timeout:.0f}s ({last}):\n{child.tail()}")


def make_adapter(root: Path) -> Path:
    root.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    (root / "adapter_config.json").write_text(json.dumps(config))
    (root / "adapter_model.safetensors").write_bytes(os.urandom(64 * 1024))
    return root


def publish(workdir: Path) -> dict[str, object]:
    """Publish the synthetic adapter as the current version of LOGICAL_ID, the operator's way."""
    adapter = make_adapter(workdir / "adapter")
    argv = [sys.executable, "-m", "gateway.cli", "publish", LOGICAL_ID, str(adapter), "--json",
            "--data-dir", str(workdir / "kvgate"), "--store", str(workdir / "store")]  # fmt: skip
    done = subprocess.run(
        argv, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"kvgate publish failed ({done.returncode}): {done.stderr.strip()}")
    doc: dict[str, object] = json.loads(done.stdout)
    return doc


def stop_leftover_redis(workdir: Path) -> None:
    """kvgate stops its embedded Redis on SIGTERM; if it was killed instead, stop the server here."""
    sock = workdir / "kvgate" / "redis" / "redis.sock"
    if not sock.exists():
        return
    import redis

    with contextlib.suppress(redis.RedisError, OSError):
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=2.0)
        client.shutdown(nosave=True)


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream stub {{
        server 127.0.0.1:{upstream_port};
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://stub;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def router_version(binary: Path) -> str:
    """vllm-router's version, from its venv's dist-info (the command has no --version)."""
    venv = binary.resolve().parent.parent
    for dist in sorted(venv.glob("lib/python*/site-packages/vllm_router-*.dist-info")):
        return dist.name.removeprefix("vllm_router-").removesuffix(".dist-info")
    return "version unknown"


def start_vllm_router(fleet: Fleet, binary: Path, upstream_url: str) -> tuple[Child, str]:
    """vllm-router, one worker (the stub), round robin. One process (it renames itself vllm::router)."""
    port = free_port()
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream_url,
            "--policy", "round_robin", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "30",
            "--log-level", "warning"]  # fmt: skip
    child = fleet.start("vllm-router", argv)
    return child, f"http://127.0.0.1:{port}"


def start_nginx(fleet: Fleet, binary: str, upstream_port: int) -> tuple[Child, str]:
    prefix = fleet.workdir / "nginx"
    prefix.mkdir()
    port = free_port()
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must reach the temp prefix
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_CONF.format(user=user, prefix=prefix, upstream_port=upstream_port, port=port))
    argv = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    child = fleet.start("nginx", argv, group=True)
    return child, f"http://127.0.0.1:{port}"


# --- load generation ------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    model: str  # what the client sends
    expect_model: str  # what the response must say
    proxy: Child | None  # None: direct to the stub


@dataclass
class Phase:
    requests: int
    errors: int
    proxy_cpu: float
    proxy_sys: float  # the kernel's part of proxy_cpu (socket syscalls, loopback TCP)
    stub_cpu: float
    wall: float
    p50_ms: float

    def proxy_us(self) -> float:
        return self.proxy_cpu / max(self.requests, 1) * 1e6

    def proxy_sys_share(self) -> float:
        return self.proxy_sys / self.proxy_cpu if self.proxy_cpu > 0 else float("nan")

    def stub_us(self) -> float:
        return self.stub_cpu / max(self.requests, 1) * 1e6


@dataclass
class Results:
    targets: list[Target]
    rounds: dict[tuple[str, str], list[Phase]] = field(default_factory=dict)
    idle_ms_per_s: dict[str, float] = field(default_factory=dict)

    def add(self, target: str, kind: str, phase: Phase) -> None:
        self.rounds.setdefault((target, kind), []).append(phase)


def payload(model: str, stream: bool) -> bytes:
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": CHUNKS,
            "temperature": 0.0, "stream": stream}  # fmt: skip
    return json.dumps(body).encode()


def response_ok(status: int, body: bytes, expect_model: str, stream: bool) -> bool:
    if status != 200:
        return False
    if f'"model":"{expect_model}"'.encode() not in body:
        return False
    if stream:
        return body.count(b"data: ") == CHUNKS + 1 and body.rstrip().endswith(b"data: [DONE]")
    return True


async def run_phase(
    session: aiohttp.ClientSession,
    target: Target,
    stub: Child,
    *,
    stream: bool,
    count: int,
    concurrency: int,
    max_seconds: float,
    measure: bool = True,
) -> Phase:
    url = target.url + "/v1/completions"
    data = payload(target.model, stream)
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    issued = 0
    deadline = time.monotonic() + max_seconds

    async def worker() -> None:
        nonlocal issued, errors
        while issued < count and time.monotonic() < deadline:
            issued += 1
            started = time.perf_counter()
            try:
                async with session.post(url, data=data, headers=headers) as response:
                    body = await response.read()
                    ok = response_ok(response.status, body, target.expect_model, stream)
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok

    proxy_before = target.proxy.cpu_times() if target.proxy and measure else (0.0, 0.0)
    stub_before = stub.cpu_seconds() if measure else 0.0
    wall_before = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - wall_before
    proxy_after = target.proxy.cpu_times() if target.proxy and measure else (0.0, 0.0)
    proxy_user, proxy_sys = proxy_after[0] - proxy_before[0], proxy_after[1] - proxy_before[1]
    stub_cpu = stub.cpu_seconds() - stub_before if measure else 0.0
    p50 = statistics.median(latencies) * 1e3 if latencies else float("nan")
    return Phase(len(latencies), errors, proxy_user + proxy_sys, proxy_sys, stub_cpu, wall, p50)


async def idle_rate(target: Target, seconds: float) -> float:
    """Background CPU of an idle proxy (kvgate polls replicas and reconciles Redis), in ms per second."""
    if target.proxy is None:
        return 0.0
    before, started = target.proxy.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (target.proxy.cpu_seconds() - before) / (time.perf_counter() - started) * 1e3


async def bench(targets: list[Target], stub: Child, args: argparse.Namespace) -> Results:
    results = Results(targets)
    timeout = aiohttp.ClientTimeout(total=60, connect=5)
    sessions = {
        t.name: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.concurrency, keepalive_timeout=120),
            timeout=timeout,
            auto_decompress=False,
        )
        for t in targets
    }
    try:
        # kvgate first: its first request loads the adapter into the stub, and the other targets send
        # the versioned name straight to the stub (same upstream body size, same stub work).
        for target in targets:
            for stream in (False, True):
                warm = await run_phase(sessions[target.name], target, stub, stream=stream,
                                       count=args.warmup, concurrency=args.concurrency,
                                       max_seconds=args.phase_seconds, measure=False)  # fmt: skip
                if warm.errors:
                    raise RuntimeError(
                        f"{target.name}: {warm.errors}/{warm.requests} warm-up requests failed"
                    )
        for target in targets:
            results.idle_ms_per_s[target.name] = await idle_rate(target, args.idle_seconds)
        kvgate = next(t.proxy for t in targets if t.name == "kvgate")
        assert kvgate is not None
        async with _py_spy(kvgate, args.py_spy), _cprofile(kvgate, args.cprofile):
            await _rounds(targets, stub, sessions, results, args)
    finally:
        for session in sessions.values():
            await session.close()
    return results


@contextlib.asynccontextmanager
async def _py_spy(child: Child, out: Path | None) -> AsyncIterator[None]:
    """Optionally sample ``child`` with py-spy (collapsed stacks) while the body runs."""
    if out is None:
        yield
        return
    binary = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [binary, "record", "--pid", str(child.process.pid), "--rate", "250", "--function",
            "--format", "raw", "--output", str(out)]  # fmt: skip
    spy = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL)
    await asyncio.sleep(1.0)  # let it attach
    try:
        yield
    finally:
        if spy.returncode is None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                await asyncio.wait_for(spy.wait(), timeout=30)
            except TimeoutError:
                spy.kill()
                await spy.wait()


@contextlib.asynccontextmanager
async def _cprofile(child: Child, out: Path | None) -> AsyncIterator[None]:
    """Optionally switch on kvgate's cProfile (``loadtest/cprofile_kvgate.py``) while the body runs."""
    if out is None:
        yield
        return
    child.process.send_signal(signal.SIGUSR1)
    try:
        yield
    finally:
        child.process.send_signal(signal.SIGUSR2)
        for _ in range(100):  # the dump is written by kvgate's signal handler
            await asyncio.sleep(0.1)
            if await asyncio.to_thread(out.exists):
                break


async def _rounds(
    targets: list[Target],
    stub: Child,
    sessions: dict[str, aiohttp.ClientSession],
    results: Results,
    args: argparse.Namespace,
) -> None:
    for round_no in range(args.rounds):
        shift = round_no % len(targets)  # rotate the order: slow drift of the machine hits all alike
        for target in targets[shift:] + targets[:shift]:
            for kind in args.kinds:
                stream = kind == "stream"
                count = args.requests if not stream else max(args.requests // 4, 1)
                phase = await run_phase(sessions[target.name], target, stub, stream=stream, count=count,
                                        concurrency=args.concurrency,
                                        max_seconds=args.phase_seconds)  # fmt: skip
                results.add(target.name, kind, phase)
                kernel = f"({100 * phase.proxy_sys_share():3.0f}% sys)" if target.proxy else " " * 10
                print(f"  round {round_no + 1} {target.name:<11} {kind:<6} {phase.requests:>6} req "
                      f"{phase.errors} err  proxy {phase.proxy_us():7.0f} µs/req {kernel}  "
                      f"stub {phase.stub_us():6.0f} µs/req  p50 {phase.p50_ms:6.2f} ms  "
                      f"{phase.wall:5.1f} s", flush=True)  # fmt: skip


# --- report ---------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: Sequence[float], digits: int = 0) -> str:
    if not values:
        return "n/a"
    med = _median(values)
    if len(values) == 1:
        return f"{med:,.{digits}f}"
    return f"**{med:,.{digits}f}** ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def _ratio(results: Results, num: str, den: str, kind: str) -> str:
    a, b = results.rounds.get((num, kind), []), results.rounds.get((den, kind), [])
    per_round = [x.proxy_us() / y.proxy_us() for x, y in zip(a, b, strict=False) if y.proxy_us() > 0]
    if not per_round:
        return "n/a"
    return f"**{_median(per_round):.2f}x** ({min(per_round):.2f}-{max(per_round):.2f})"


def render(results: Results, args: argparse.Namespace, env: dict[str, str]) -> str:
    names = [t.name for t in results.targets]
    lines = [
        "# Proxy CPU cost: kvgate side by side",
        "",
        f"Generated by `loadtest/proxy_overhead.py` on {env['date']}. Command (from the repository root):",
        "",
        "```sh",
        env["command"],
        "```",
        "",
        f"{args.rounds} rounds; per round and target: {args.requests} non-streaming `/v1/completions`, then "
        f"{max(args.requests // 4, 1)} streaming ones ({CHUNKS} SSE chunks + `[DONE]`), concurrency "
        f"{args.concurrency}, keep-alive, loopback. CPU = utime+stime delta of the proxy process(es) "
        "over the phase ÷ requests. **Bold: median over rounds**, (min-max) across rounds.",
        "",
        "| target | proxy CPU µs / request | proxy CPU µs / 32-chunk stream | kernel share (req / stream) "
        "| client p50 ms (req / stream) | stub CPU µs (req / stream) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target in results.targets:
        plain = results.rounds.get((target.name, "plain"), [])
        stream = results.rounds.get((target.name, "stream"), [])
        if target.proxy is None:
            cpu_plain = cpu_stream = "0 (no proxy)"
            kernel = "-"
        else:
            cpu_plain = _spread([p.proxy_us() for p in plain])
            cpu_stream = _spread([p.proxy_us() for p in stream])
            kernel = " / ".join(
                f"{100 * _median([p.proxy_sys_share() for p in phases]):.0f}%" for phases in (plain, stream)
            )
        p50 = f"{_median([p.p50_ms for p in plain]):.2f} / {_median([p.p50_ms for p in stream]):.2f}"
        stub = f"{_median([p.stub_us() for p in plain]):.0f} / {_median([p.stub_us() for p in stream]):.0f}"
        errors = sum(p.errors for p in plain + stream)
        total = sum(p.requests for p in plain + stream)
        cells = [env["label:" + target.name], cpu_plain, cpu_stream, kernel, p50, stub, f"{errors} / {total}"]
        lines.append("| " + " | ".join(cells) + " |")
    if "nginx" not in names:
        lines.append(f"| nginx `proxy_pass` | {env['nginx']} | - | - | - | - | - |")
    if "vllm-router" not in names:
        lines.append(f"| vllm-router | {env['vllm-router']} | - | - | - | - | - |")
    lines += [
        "",
        "Ratios, taken within each round (same machine state), then the median over rounds:",
        "",
        "| ratio | per request | per 32-chunk stream |",
        "| --- | --- | --- |",
        f"| kvgate / naive aiohttp proxy | {_ratio(results, 'kvgate', 'naive', 'plain')} "
        f"| {_ratio(results, 'kvgate', 'naive', 'stream')} |",
    ]
    if "nginx" in names:
        lines.append(
            f"| kvgate / nginx | {_ratio(results, 'kvgate', 'nginx', 'plain')} "
            f"| {_ratio(results, 'kvgate', 'nginx', 'stream')} |"
        )
    else:
        lines.append(f"| kvgate / nginx | n/a: {env['nginx']} | n/a |")
    if "vllm-router" in names:
        lines.append(
            f"| kvgate / vllm-router | {_ratio(results, 'kvgate', 'vllm-router', 'plain')} "
            f"| {_ratio(results, 'kvgate', 'vllm-router', 'stream')} |"
        )
    else:
        lines.append(f"| kvgate / vllm-router | n/a: {env['vllm-router']} | n/a |")
    kv_plain = _median([p.proxy_us() for p in results.rounds.get(("kvgate", "plain"), [])])
    kv_stream = _median([p.proxy_us() for p in results.rounds.get(("kvgate", "stream"), [])])

    def verdict(value: float, kind: str) -> str:
        goal = TARGET_US[kind]
        if value != value:  # NaN: this kind was not measured
            return "not measured"
        return f"{value:,.0f} µs vs ≤ {goal:,.0f} µs: " + (
            "within target" if value <= goal else "**over target**"
        )

    others = [name for name in names if name != "kvgate"]
    senders = ", ".join(others[:-1]).capitalize() + " and " + others[-1] if len(others) > 1 else "Direct"
    idle = ", ".join(
        f"{name} {results.idle_ms_per_s.get(name, 0.0):.2f}" for name in names if name != "direct"
    )
    lines += [
        "",
        f"Targets for kvgate on this 2-core machine: per request {verdict(kv_plain, 'plain')}; "
        f"per stream {verdict(kv_stream, 'stream')}.",
        "",
        "Quoted reference figures (µs per request / per stream; from the team's brief, **not measured by "
        "this run**): " + "; ".join(f"{k} ≈ {a} / {b}" for k, (a, b) in REFERENCE_US.items()) + ".",
        "",
        "Notes:",
        "",
        *(
            ["- **This run profiled kvgate**: its figures are inflated; do not compare them."]
            if args.py_spy or args.cprofile
            else []
        ),
        f"- Idle background CPU of each proxy (ms of CPU per second, measured before the rounds): {idle}. "
        "kvgate polls its replicas and reconciles Redis every second; that share is included in the figures "
        "above (it is small next to a phase's CPU).",
        f"- CPU times come in ticks of {1000 / CLK_TCK:.0f} ms; a phase's total is tens to hundreds of "
        "ticks, so a figure carries a few % of quantisation noise.",
        "- Kernel share: stime / (utime + stime) of the proxy; on loopback most of it is socket sends "
        "(the kernel runs the receiver's TCP path in the sender's syscall) and epoll.",
        "- The load generator, the stub and the proxy share the 2 cores: latencies include that contention, "
        "CPU figures do not (each is one process's own time).",
        f"- {senders} send the versioned name (`"
        + env["versioned"]
        + "`) straight to the stub"
        + (" (vllm-router passes it through unchanged)" if "vllm-router" in names else "")
        + "; kvgate "
        f"gets the logical ID `{LOGICAL_ID}` and rewrites it both ways, so the stub does the same work.",
        "- nginx runs with `worker_processes 1` (one core, like the Python proxies); master + worker CPU "
        "summed.",
        *(
            [
                f"- vllm-router ({env['vllm-router']}): `--policy round_robin`, the stub as its only worker, "
                "`--log-level warning`; one process (all its threads, so it may use both cores); it "
                "health-checks the worker in the background (in its idle figure above)."
            ]
            if "vllm-router" in names
            else []
        ),
        "",
        f"Machine: {env['machine']}. Tree measured: {env['revision']}. Load average at start / end: "
        f"{env['load_start']} / {env['load_end']}.",
        "",
    ]
    return "\n".join(lines)


def _load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _revision() -> str:
    """The commit measured, and whether gateway/ had uncommitted changes (others edit it in parallel)."""

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return head + (" + uncommitted changes in gateway/" if git("status", "--porcelain", "gateway") else "")


def _command(argv: Sequence[str]) -> str:
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable
    return shlex.join([python, "-m", "loadtest.proxy_overhead", *argv])


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.proxy_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=2000, help="non-streaming requests per round and "
                        "target; streams are a quarter of it (default 2000)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured requests per target and kind")
    parser.add_argument("--phase-seconds", type=float, default=180.0, help="time bound of one phase")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle window for background CPU")
    parser.add_argument(
        "--cprofile",
        type=Path,
        metavar="FILE",
        help="run kvgate under cProfile (CPU clock) in the rounds, dump to FILE (.pstats); perturbs figures",
    )
    parser.add_argument("--kinds", default="plain,stream", help="which phases to measure: plain, stream "
                        "or both, comma-separated (default both)")  # fmt: skip
    parser.add_argument("--vllm-router", type=Path, default=Path(".venv-router/bin/vllm-router"),
                        help="vllm-router command, relative to the repository root unless absolute; "
                        "skipped if missing (default .venv-router/bin/vllm-router)")  # fmt: skip
    parser.add_argument("--out", default="docs/perf.md", help="markdown report ('-': print only)")
    parser.add_argument("--py-spy", type=Path, metavar="FILE", help="also sample kvgate with py-spy in the "
                        "rounds (raw stacks to FILE, summary printed); perturbs the figures")  # fmt: skip
    args = parser.parse_args(argv)
    if args.requests < 1 or args.rounds < 1 or args.concurrency < 1:
        parser.error("--requests, --rounds and --concurrency must be positive")
    if args.py_spy is not None:
        args.py_spy = args.py_spy.resolve()
    if args.cprofile is not None:
        args.cprofile = args.cprofile.resolve()
        with contextlib.suppress(FileNotFoundError):
            args.cprofile.unlink()  # a fresh dump marks the end of profiling
    args.kinds = tuple(kind for kind in KINDS if kind in args.kinds.split(","))
    if not args.kinds:
        parser.error(f"--kinds takes {' and/or '.join(KINDS)}")
    return args


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    previous: Callable[[int, FrameType | None], object] | int | None = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    env = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command(raw_argv),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}",
        "load_start": _load_average(),
        "revision": _revision(),
        "label:direct": "direct → stub (no proxy)",
        "label:kvgate": "**kvgate** (`kvgate serve`)",
        "label:naive": "naive aiohttp proxy",
        "label:nginx": "nginx `proxy_pass`",
        "label:vllm-router": "vllm-router (Rust, `round_robin`)",
    }
    py = sys.executable
    with _signals_exit(), tempfile.TemporaryDirectory(prefix="kvgate-perf-") as tmp:
        workdir = Path(tmp)
        try:
            with Fleet(workdir) as fleet:
                fleet.callback(stop_leftover_redis, workdir)  # runs after kvgate has stopped
                stub_port = free_port()
                stub = fleet.start("stub", [py, "-m", "loadtest.stub_server", "--port", str(stub_port),
                                            "--chunks", str(CHUNKS)])  # fmt: skip
                stub_url = f"http://127.0.0.1:{stub_port}"
                wait_ready(stub, stub_url + "/v1/models")

                published = publish(workdir)
                versioned = str(published["name"])
                env["versioned"] = versioned
                kv_port = free_port()
                kvgate_cmd = ["-m", "gateway.cli"]
                if args.cprofile is not None:
                    kvgate_cmd = ["-m", "loadtest.cprofile_kvgate", str(args.cprofile)]
                kvgate = fleet.start("kvgate", [py, *kvgate_cmd, "serve", "--replica", stub_url,
                                                "--data-dir", str(workdir / "kvgate"),
                                                "--store", str(workdir / "store"),
                                                "--port", str(kv_port)])  # fmt: skip
                kv_url = f"http://127.0.0.1:{kv_port}"
                wait_ready(kvgate, kv_url + "/healthz")

                naive_port = free_port()
                naive = fleet.start("naive", [py, "-m", "loadtest.naive_proxy", "--port", str(naive_port),
                                              "--upstream", stub_url])  # fmt: skip
                naive_url = f"http://127.0.0.1:{naive_port}"
                wait_ready(naive, naive_url + "/v1/models")

                targets = [
                    Target("kvgate", kv_url, LOGICAL_ID, LOGICAL_ID, kvgate),
                    Target("direct", stub_url, versioned, versioned, None),
                    Target("naive", naive_url, versioned, versioned, naive),
                ]
                nginx_binary = shutil.which("nginx")
                if nginx_binary is None:
                    env["nginx"] = (
                        "not installed here (`nginx` not on PATH; `apt-get install nginx` to add it)"
                    )
                    print("nginx: not installed (no `nginx` on PATH): skipped", flush=True)
                else:
                    nginx, nginx_url = start_nginx(fleet, nginx_binary, stub_port)
                    wait_ready(nginx, nginx_url + "/v1/models")
                    targets.append(Target("nginx", nginx_url, versioned, versioned, nginx))
                    env["nginx"] = nginx_binary
                router_binary = ROOT / args.vllm_router  # an absolute path stays as it is
                if not (router_binary.is_file() and os.access(router_binary, os.X_OK)):
                    env["vllm-router"] = (
                        f"not installed here (no `{args.vllm_router}`; `make loadtest-proxy` installs it)"
                    )
                    print(f"vllm-router: not installed (no {router_binary}): skipped", flush=True)
                else:
                    router, router_url = start_vllm_router(fleet, router_binary, stub_url)
                    wait_ready(router, router_url + "/health", timeout=60.0)
                    targets.append(Target("vllm-router", router_url, versioned, versioned, router))
                    env["vllm-router"] = f"{args.vllm_router}, {router_version(router_binary)}"

                print(f"targets: {', '.join(t.name for t in targets)}; published {versioned}", flush=True)
                results = asyncio.run(bench(targets, stub, args))
        except RuntimeError as exc:
            print(f"proxy_overhead: {exc}", file=sys.stderr)
            return 1
    env["load_end"] = _load_average()
    if args.cprofile is not None and args.cprofile.exists():
        print(f"\ncProfile of kvgate written to {args.cprofile}")
        print(summarize_pstats(args.cprofile))
    if args.py_spy is not None and args.py_spy.exists():
        print(f"\npy-spy profile of kvgate written to {args.py_spy}")
        print(summarize(args.py_spy.read_text(errors="replace")).render())
    report = render(results, args, env)
    print()
    print(report)
    if args.out != "-":
        out = Path(args.out)
        if not out.is_absolute():
            out = ROOT / out
        out.parent.mkdir(parents=True, exist_ok=True)
        generated_docs.write_report(out, report)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
