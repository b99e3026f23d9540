"""Proxy cost side by side under wrk: direct, kvgate, vllm-router and nginx, the same stub behind each.

Every server runs in its own process on loopback: the vLLM-API stub (``loadtest/stub_server.py``, 32 SSE
chunks a stream, uvloop), ``kvgate serve`` (one process, on its real adapter path: an adapter published
through ``kvgate publish`` as the current version of ``bench``, embedded Redis), Rust ``vllm-router``
(``round_robin`` over the one stub; ``make loadtest-proxy`` installs it into ``.venv-router``) and nginx
``proxy_pass`` (``worker_processes 1``). The load is Debian's ``wrk`` (one thread) with a Lua script that
POSTs the body: non-streaming and streaming completions at concurrency 1, 64 and 256, a few seconds a cell.
Each round runs every cell for every target one after the other (the order rotates between rounds), so a
ratio is taken between figures measured side by side; figures are medians over rounds. Time to first SSE
chunk comes from a Python client (aiohttp, one stream at a time, every stream checked: model name, 32
chunks, ``[DONE]``); what a proxy adds is its figure minus direct's in the same round.

CPU per request: utime+stime of each proxy's process tree (the process, its live descendants and reaped
children: kvgate's embedded redis-server, nginx's worker), read from /proc before and after each cell,
divided by the requests wrk completed. Foreign load: the machine's busy CPU (/proc/stat) during the cell
minus what the measured processes used (proxy tree, stub, wrk, this script), in cores; the 1-minute load
average at each cell's start is recorded too.

``--profile`` then samples ``kvgate serve`` with ``py-spy record`` under the concurrency-64 non-streaming
load: a flame graph (SVG) and a top-N summary of the folded stacks (``loadtest/hotspots.py``).

Run from the repository root::

    .venv/bin/python -m loadtest.proxy_overhead [--rounds 3] [--seconds 4] [--out docs/perf.md] \\
        [--profile docs/perf-profile]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import aiohttp

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.hotspots import Summary, summarize

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
LOGICAL_ID = "bench"
CHUNKS = 32
KINDS = ("plain", "stream")
CONCURRENCY = (1, 64, 256)
PEERS = ("vllm-router", "nginx")
LABELS = {
    "direct": "direct (the stub alone)",
    "kvgate": "**kvgate** (`kvgate serve --workers 1`)",
    "kvgate-2": "**kvgate** (`kvgate serve --workers 2`)",
    "vllm-router": "vllm-router (Rust, `round_robin`)",
    "nginx": "nginx `proxy_pass`",
}
FOREIGN_FLAG = 0.25  # cores used outside the measured processes above which a cell is flagged


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

    def cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the process tree: the process (all threads), its live descendants
        (kvgate's embedded redis-server, nginx's worker) and the children it has reaped."""
        return tree_cpu_times(self.process.pid)

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


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant's pid, from /proc (parents before their children)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def tree_cpu_times(root: int) -> tuple[float, float]:
    """(utime + cutime, stime + cstime) of ``root`` and every live descendant, in seconds, from /proc."""
    user = system = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is None:
            continue
        user += int(fields[11]) + int(fields[13])  # utime, cutime (reaped children)
        system += int(fields[12]) + int(fields[14])  # stime, cstime
    return user / CLK_TCK, system / CLK_TCK


class Fleet(contextlib.ExitStack):
    """Every child started here; all of them stop on exit, in reverse order, whatever happened."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: Sequence[str]) -> Child:
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
        child = Child(name, process, log)
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


def publish(workdir: Path, data: str = "kvgate") -> dict[str, object]:
    """Publish the synthetic adapter as the current version of LOGICAL_ID, the operator's way, into the
    embedded Redis under ``workdir / data`` (the same bytes again: the same version)."""
    adapter = workdir / "adapter"
    if not adapter.is_dir():
        make_adapter(adapter)
    argv = [sys.executable, "-m", "gateway.cli", "publish", LOGICAL_ID, str(adapter), "--json",
            "--data-dir", str(workdir / data), "--store", str(workdir / "store")]  # fmt: skip
    done = subprocess.run(
        argv, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"kvgate publish failed ({done.returncode}): {argv} {(done.stdout + done.stderr).strip()[-300:]}"
        )
    doc: dict[str, object] = json.loads(done.stdout)
    return doc


def stop_leftover_redis(workdir: Path, data: str = "kvgate") -> None:
    """kvgate stops its embedded Redis on SIGTERM; if it was killed instead, stop the server here."""
    sock = workdir / data / "redis" / "redis.sock"
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
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
{http}}}
"""
"""One nginx worker; ``http``: its http block's own directives (``NGINX_STUB``'s, or a benchmark's)."""
NGINX_STUB = """\
    upstream stub {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
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


def start_nginx(
    fleet: Fleet, binary: str, upstream_port: int, http: str = NGINX_STUB, **fields: object
) -> tuple[Child, str]:
    """nginx in front of the stub at ``upstream_port``: ``NGINX_CONF`` with ``http`` (its ``port`` and
    ``upstream_port`` filled in, and ``fields``)."""
    prefix = fleet.workdir / "nginx"
    prefix.mkdir()
    port = free_port()
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must reach the temp prefix
    conf = prefix / "nginx.conf"
    own = http.format(upstream_port=upstream_port, port=port, **fields)
    conf.write_text(NGINX_CONF.format(user=user, prefix=prefix, http=own))
    argv = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
    child = fleet.start("nginx", argv)
    return child, f"http://127.0.0.1:{port}"


# --- load generation ------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    model: str  # what the client sends
    expect_model: str  # what the response must say
    proxy: Child | None  # None: direct to the stub


def payload(model: str, stream: bool) -> bytes:
    body = {"model": model, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": CHUNKS,
            "temperature": 0.0, "stream": stream}  # fmt: skip
    return json.dumps(body).encode()


WRK_SCRIPT = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRK {{\\"requests\\":%d,\\"duration_us\\":%d,\\"connect\\":%d,\\"read\\":%d,\\"write\\":%d," ..
    "\\"status\\":%d,\\"timeout\\":%d,\\"p50_us\\":%d,\\"p99_us\\":%d}}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_script(workdir: Path, target: Target, kind: str) -> Path:
    path = workdir / f"wrk-{target.name}-{kind}.lua"
    path.write_text(WRK_SCRIPT.format(body=payload(target.model, kind == "stream").decode()))
    return path


@dataclass
class Cell:
    """One wrk run of one target: kind (plain or stream) at one concurrency."""

    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    proxy_cpu: float  # seconds, the proxy's process tree
    proxy_sys: float  # the kernel's part of it
    stub_cpu: float
    foreign_cores: float  # CPU used outside the measured processes, in cores
    load1: float  # the 1-minute load average at the start

    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("nan")

    def cpu_us(self) -> float:
        return self.proxy_cpu / self.requests * 1e6 if self.requests else float("nan")

    def stub_us(self) -> float:
        return self.stub_cpu / self.requests * 1e6 if self.requests else float("nan")


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def _own_and_waited() -> float:
    """CPU seconds of this script and of its reaped children (wrk runs are reaped when they finish)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def run_wrk(target: Target, stub: Child, script: Path, *, concurrency: int, seconds: int) -> Cell:
    argv = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "10s", "-s", str(script),
            target.url + "/v1/completions"]  # fmt: skip
    load1 = os.getloadavg()[0]
    proxy0 = target.proxy.cpu_times() if target.proxy else (0.0, 0.0)
    stub0, busy0, mine0 = stub.cpu_seconds(), machine_busy(), _own_and_waited()
    wall0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    wall = time.perf_counter() - wall0
    proxy1 = target.proxy.cpu_times() if target.proxy else (0.0, 0.0)
    stub1, busy1, mine1 = stub.cpu_seconds(), machine_busy(), _own_and_waited()
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("WRK ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(
            f"wrk against {target.name} failed ({done.returncode}): {argv} "
            f"{(done.stdout + done.stderr).strip()[-300:]}"
        )
    report = json.loads(line.removeprefix("WRK "))
    errors = sum(report[k] for k in ("connect", "read", "write", "status", "timeout"))
    proxy_user, proxy_sys = proxy1[0] - proxy0[0], proxy1[1] - proxy0[1]
    measured = proxy_user + proxy_sys + (stub1 - stub0) + (mine1 - mine0)
    foreign = max(busy1 - busy0 - measured, 0.0) / wall
    return Cell(
        requests=int(report["requests"]),
        errors=int(errors),
        seconds=report["duration_us"] / 1e6,
        p50_ms=report["p50_us"] / 1e3 if report["requests"] else float("nan"),
        p99_ms=report["p99_us"] / 1e3 if report["requests"] else float("nan"),
        proxy_cpu=proxy_user + proxy_sys,
        proxy_sys=proxy_sys,
        stub_cpu=stub1 - stub0,
        foreign_cores=foreign,
        load1=load1,
    )


async def first_chunks(target: Target, count: int) -> tuple[list[float], int]:
    """``count`` streams one at a time on one keep-alive connection: each one's time to its first SSE
    chunk (ms), and how many streams were wrong (status, model name, chunk count, ``[DONE]``)."""
    url = target.url + "/v1/completions"
    data = payload(target.model, True)
    headers = {"Content-Type": "application/json"}
    want = f'"model":"{target.expect_model}"'.encode()
    times: list[float] = []
    wrong = 0
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(url, data=data, headers=headers) as response:
                body = await response.content.readany()
                while b"data: " not in body:  # the first bytes may be less than a chunk
                    more = await response.content.readany()
                    if not more:
                        break
                    body += more
                times.append((time.perf_counter() - started) * 1e3)
                body += await response.read()
            ok = response.status == 200 and want in body and body.count(b"data: ") == CHUNKS + 1
            wrong += not (ok and body.rstrip().endswith(b"data: [DONE]"))
    return times, wrong


def check_plain(target: Target) -> None:
    """One non-streaming request: 200 and the model name the client sent (kvgate rewrites it back)."""
    request = urllib.request.Request(
        target.url + "/v1/completions",
        data=payload(target.model, False),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        body = answer.read()
    if f'"model":"{target.expect_model}"'.encode() not in body:
        raise RuntimeError(f"{target.name}: the answer does not name {target.expect_model}: {body[:300]!r}")


@dataclass
class Results:
    targets: list[Target]
    cells: dict[tuple[str, str, int], list[Cell]] = field(default_factory=dict)  # (target, kind, c)
    ttfc: dict[str, list[float]] = field(default_factory=dict)  # target: each round's p50 (ms)
    wrong_streams: int = 0
    loads: list[float] = field(default_factory=list)

    def of(self, target: str, kind: str, concurrency: int) -> list[Cell]:
        return self.cells.get((target, kind, concurrency), [])


def bench(targets: list[Target], stub: Child, workdir: Path, args: argparse.Namespace) -> Results:
    results = Results(targets)
    scripts = {(t.name, k): wrk_script(workdir, t, k) for t in targets for k in KINDS}
    for target in targets:  # kvgate first: its first request loads the adapter into the stub
        check_plain(target)
        for kind in KINDS:
            run_wrk(target, stub, scripts[target.name, kind], concurrency=64, seconds=args.warmup)
    for round_no in range(args.rounds):
        shift = round_no % len(targets)  # rotate the order: a drift of the machine hits all alike
        order = targets[shift:] + targets[:shift]
        for kind in KINDS:
            for concurrency in CONCURRENCY:
                for target in order:
                    cell = run_wrk(target, stub, scripts[target.name, kind], concurrency=concurrency,
                                   seconds=args.seconds)  # fmt: skip
                    results.cells.setdefault((target.name, kind, concurrency), []).append(cell)
                    results.loads.append(cell.load1)
                    flag = "  FOREIGN LOAD" if cell.foreign_cores > FOREIGN_FLAG else ""
                    print(f"  round {round_no + 1} {kind:<6} c{concurrency:<4} {target.name:<12} "
                          f"{cell.rps():8.0f} req/s  {cell.cpu_us():7.0f} µs CPU/req  p50 {cell.p50_ms:7.2f} "
                          f"p99 {cell.p99_ms:7.2f} ms  {cell.errors} err  foreign {cell.foreign_cores:.2f} "
                          f"cores  load {cell.load1:.2f}{flag}", flush=True)  # fmt: skip
        for target in order:
            times, wrong = asyncio.run(first_chunks(target, args.streams))
            results.ttfc.setdefault(target.name, []).append(statistics.median(times))
            results.wrong_streams += wrong
            p50 = statistics.median(times)
            print(f"  round {round_no + 1} first chunk  {target.name:<12} p50 {p50:6.3f} "
                  f"ms ({len(times)} streams, {wrong} wrong)", flush=True)  # fmt: skip
    return results


def profile_kvgate(target: Target, stub: Child, script: Path, out: Path, seconds: int) -> Summary:
    """``py-spy record`` of kvgate under concurrency-64 non-streaming load: ``out``.svg (flame graph) and
    ``out``.txt (a top-N summary of the folded stacks of a second recording), whose summary it returns."""
    assert target.proxy is not None
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    pid = str(target.proxy.process.pid)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".raw")
    for fmt, path in (("flamegraph", out.with_suffix(".svg")), ("raw", raw)):
        argv = [spy, "record", "--pid", pid, "--rate", "100", "--duration", f"{seconds:g}", "--nonblocking",
                "--format", fmt, "--output", str(path)]  # fmt: skip
        recorder = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        run_wrk(target, stub, script, concurrency=64, seconds=seconds + 2)
        _, err = recorder.communicate(timeout=60)
        if recorder.returncode != 0:
            raise RuntimeError(
                f"py-spy record failed ({recorder.returncode}): {err.decode(errors='replace')}"
            )
    summary = summarize(raw.read_text(errors="replace"))
    raw.unlink()
    text = (
        f"py-spy record --rate 100 --nonblocking of `kvgate serve` (one process) for {seconds:g} s under wrk "
        f"at concurrency 64, non-streaming; flame graph: {out.with_suffix('.svg').name}\n\n"
        f"{summary.render(top=15)}\n"
    )
    out.with_suffix(".txt").write_text(text)
    return summary


# --- report ---------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    clean = [v for v in values if v == v]  # NaN: nothing measured
    return statistics.median(clean) if clean else float("nan")


def _spread(values: Sequence[float], digits: int = 0) -> str:
    clean = [v for v in values if v == v]
    if not clean:
        return "n/a"
    med = f"{_median(clean):,.{digits}f}"
    return med if len(clean) == 1 else f"{med} ({min(clean):,.{digits}f}-{max(clean):,.{digits}f})"


def per_round(a: Sequence[Cell], b: Sequence[Cell], value: Callable[[Cell], float]) -> list[float]:
    """``value(a) / value(b)`` for each round (the two measured side by side)."""
    return [value(x) / value(y) for x, y in zip(a, b, strict=False) if value(y) > 0]


def ratio(
    results: Results,
    peer: str,
    kind: str,
    concurrency: int,
    value: Callable[[Cell], float],
    mine: str = "kvgate",
) -> float:
    return _median(per_round(results.of(mine, kind, concurrency), results.of(peer, kind, concurrency), value))


def added(results: Results, name: str) -> tuple[float, float]:
    """What ``name`` adds to direct's p50 at concurrency 1 (ms): non-streaming (wrk), first chunk (client)."""
    mine, base = results.of(name, "plain", 1), results.of("direct", "plain", 1)
    plain = [x.p50_ms - y.p50_ms for x, y in zip(mine, base,
                                                   strict=False)]  # fmt: skip
    first = [x - y for x, y in zip(results.ttfc.get(name, []), results.ttfc.get("direct", []), strict=False)]
    return _median(plain), _median(first)


def _x(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}x"


def targets_table(results: Results, names: Sequence[str]) -> list[str]:
    """The issue's targets (issue 19), met or missed and by how much."""
    rows = ["| target (issue 19) | measured | verdict |", "| --- | --- | --- |"]
    router = "vllm-router" in names

    def at_most(value: float, goal: float, unit: str = "x") -> str:
        if value != value:
            return "not measured"

        def fmt(v: float) -> str:
            return f"{v:.2f}x" if unit == "x" else f"{v:.3f} ms"

        if value <= goal:
            return f"met ({fmt(value)} ≤ {fmt(goal)})"
        return f"**missed** by {value / goal:.2f}x ({fmt(value)} against ≤ {fmt(goal)})"

    def at_least(value: float, goal: float) -> str:
        if value != value:
            return "not measured"
        if value >= goal:
            return f"met ({value:.2f}x ≥ {goal:.2f}x)"
        return f"**missed**: {100 * (1 - value / goal):.0f}% short ({value:.2f}x against ≥ {goal:.2f}x)"

    if router:
        r = ratio(results, "vllm-router", "plain", 64, Cell.cpu_us)
        rows.append(
            f"| CPU per non-streaming request at c64 ≤ 2.0x vllm-router's | {_x(r)} | {at_most(r, 2.0)} |"
        )
        r = ratio(results, "vllm-router", "stream", 64, Cell.cpu_us)
        rows.append(f"| CPU per 32-chunk stream at c64 ≤ 1.0x vllm-router's | {_x(r)} | {at_most(r, 1.0)} |")
        for c in (64, 256):
            r = ratio(results, "vllm-router", "stream", c, Cell.rps)
            rows.append(
                f"| streams/s at c{c} ≥ 1.0x vllm-router (one process) | {_x(r)} | {at_least(r, 1.0)} |"
            )
        for c in (64, 256):
            r = ratio(results, "vllm-router", "plain", c, Cell.rps)
            rows.append(f"| non-streaming req/s at c{c} ≥ 0.5x vllm-router (one process) | {_x(r)} "
                        f"| {at_least(r, 0.5)} |")  # fmt: skip
    plain, first = added(results, "kvgate")
    rows.append(
        f"| added p50 at c1, non-streaming ≤ 0.25 ms | {plain:.3f} ms | {at_most(plain, 0.25, 'ms')} |"
    )
    rows.append(
        f"| added p50 at c1, to first chunk ≤ 0.3 ms | {first:.3f} ms | {at_most(first, 0.3, 'ms')} |"
    )
    kv = _median([c.p99_ms for c in results.of("kvgate", "stream", 256)])
    peers = {p: _median([c.p99_ms for c in results.of(p, "stream", 256)]) for p in PEERS if p in names}
    if peers:
        worst = min(peers.values())
        said = ", ".join(f"{p} {v:,.1f} ms" for p, v in peers.items())
        if kv != kv or worst != worst:
            verdict = "not measured (no stream completed in a cell)"
        else:
            verdict = "met" if kv < worst else f"**missed** (kvgate {kv / worst:.2f}x the lower peer)"
        rows.append(f"| stream p99 at c256 below both peers' | kvgate {kv:,.1f} ms; {said} | {verdict} |")
    if "kvgate-2" in names:
        for c in (64, 256):
            if router:
                r = ratio(results, "vllm-router", "plain", c, Cell.rps, mine="kvgate-2")
                rows.append(f"| `--workers 2`: non-streaming req/s at c{c} ≥ 0.9x vllm-router | {_x(r)} "
                            f"| {at_least(r, 0.9)} |")  # fmt: skip
            r = ratio(results, "kvgate", "plain", c, Cell.rps, mine="kvgate-2")
            rows.append(f"| `--workers 2`: non-streaming req/s at c{c} ≥ 1.7x one worker | {_x(r)} "
                        f"| {at_least(r, 1.7)} |")  # fmt: skip
    return rows


def profile_table(profile: Summary, base: str, top: int = 10) -> list[str]:
    """The profile's top frames: each sample charged to its deepest gateway/ frame, and leaf frames."""
    attributed = profile.attributed.most_common(top)
    leaf = profile.leaf.most_common(top)
    rows = [
        f"Where kvgate's CPU goes under the c64 non-streaming load (py-spy, {profile.total} samples of "
        f"`kvgate serve`; [{base}.svg]({base}.svg) is the flame graph, [{base}.txt]({base}.txt) the longer "
        "list): share of samples charged to the deepest gateway/ frame (with the library code it called), "
        "and leaf frames (own time, any module).",
        "",
        "| deepest gateway/ frame | share | leaf frame | share |",
        "| --- | ---: | --- | ---: |",
    ]
    for i in range(max(len(attributed), len(leaf))):
        a = attributed[i] if i < len(attributed) else ("", 0)
        b = leaf[i] if i < len(leaf) else ("", 0)
        rows.append(
            f"| `{a[0]}` | {100 * a[1] / profile.total:.1f}% | `{b[0]}` | {100 * b[1] / profile.total:.1f}% |"
        )
    return rows


def render(results: Results, args: argparse.Namespace, env: dict[str, str], profile: Summary | None) -> str:
    names = [t.name for t in results.targets]
    flagged = sum(c.foreign_cores > FOREIGN_FLAG for cells in results.cells.values() for c in cells)
    total = sum(len(cells) for cells in results.cells.values())
    lines = [
        "# Proxy cost: kvgate side by side",
        "",
        f"{args.rounds} rounds; in each, every cell (kind x concurrency) runs for every target one after the "
        f"other, wrk for {args.seconds} s a cell (one wrk thread, keep-alive, loopback). Figures are medians "
        "over rounds, (min-max) where shown; ratios are taken within each round (targets measured side by "
        "side), then their median. CPU = utime+stime of the proxy's process tree (/proc) over the cell ÷ "
        "requests completed. *Foreign* = cores used during the cell by processes other than the proxy, "
        f"the stub, wrk and this script (another benchmark, a test suite); a cell above {FOREIGN_FLAG} cores "
        "is flagged ⚠.",
        "",
        "| kind | c | target | req/s | CPU µs / request | kernel share | p50 ms | p99 ms | stub CPU µs / req "
        "| errors | foreign cores |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in KINDS:
        for concurrency in CONCURRENCY:
            for target in results.targets:
                cells = results.of(target.name, kind, concurrency)
                if not cells:
                    continue
                if target.proxy is None:
                    cpu, kernel = "0 (no proxy)", "-"
                else:
                    cpu = _spread([c.cpu_us() for c in cells])
                    kernel = (
                        f"{100 * _median([c.proxy_sys / c.proxy_cpu for c in cells if c.proxy_cpu]):.0f}%"
                    )
                foreign = _median([c.foreign_cores for c in cells])
                flag = " ⚠" if any(c.foreign_cores > FOREIGN_FLAG for c in cells) else ""
                lines.append(
                    f"| {'stream' if kind == 'stream' else 'plain'} | {concurrency} | {LABELS[target.name]} "
                    f"| {_spread([c.rps() for c in cells])} | {cpu} | {kernel} "
                    f"| {_median([c.p50_ms for c in cells]):,.2f} "
                    f"| {_median([c.p99_ms for c in cells]):,.2f} "
                    f"| {_median([c.stub_us() for c in cells]):,.0f} | {sum(c.errors for c in cells)} "
                    f"| {_spread([c.foreign_cores for c in cells], 2) if foreign == foreign else 'n/a'}"
                    f"{flag} |"
                )

    peers = [p for p in PEERS if p in names]
    head = " | ".join(f"CPU / req ÷ {p}" for p in peers) + " | " + " | ".join(f"req/s ÷ {p}" for p in peers)
    lines += [
        "",
        "kvgate against each peer (per-round ratios, median; CPU: lower is better, req/s: higher is better):",
        "",
        f"| target | kind | c | {head} |",
        "| --- | --- | ---: |" + " ---: |" * (2 * len(peers)),
    ]
    mine = [name for name in ("kvgate", "kvgate-2") if name in names]
    for name in mine:
        for kind in KINDS:
            for concurrency in CONCURRENCY:
                row = [_x(ratio(results, p, kind, concurrency, Cell.cpu_us, mine=name)) for p in peers]
                row += [_x(ratio(results, p, kind, concurrency, Cell.rps, mine=name)) for p in peers]
                lines.append(f"| {LABELS[name]} | {kind} | {concurrency} | " + " | ".join(row) + " |")
    if len(mine) == 2:
        lines += [
            "",
            "Two workers against one (per-round ratios, median):",
            "",
            "| kind | c | req/s ÷ one worker | CPU / req ÷ one worker |",
            "| --- | ---: | ---: | ---: |",
        ]
        for kind in KINDS:
            for concurrency in CONCURRENCY:
                speed = ratio(results, "kvgate", kind, concurrency, Cell.rps, mine="kvgate-2")
                cost = ratio(results, "kvgate", kind, concurrency, Cell.cpu_us, mine="kvgate-2")
                lines.append(f"| {kind} | {concurrency} | {_x(speed)} | {_x(cost)} |")
    lines += [
        "",
        "Latency at concurrency 1: wrk's p50 (non-streaming) and the time to the first SSE chunk "
        f"({args.streams} "
        "streams a round, one at a time, from a Python aiohttp client); *added* = the target's figure minus "
        "direct's in the same round, median over rounds.",
        "",
        "| target | p50 ms, non-streaming | added ms | first chunk p50 ms | added ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for target in results.targets:
        plain = _median([c.p50_ms for c in results.of(target.name, "plain", 1)])
        first = _median(results.ttfc.get(target.name, []))
        if target.name == "direct":
            lines.append(f"| {LABELS['direct']} | {plain:.3f} | - | {first:.3f} | - |")
        else:
            add_plain, add_first = added(results, target.name)
            lines.append(
                f"| {LABELS[target.name]} | {plain:.3f} | {add_plain:+.3f} | {first:.3f} | {add_first:+.3f} |"
            )
    lines += ["", *targets_table(results, names), ""]
    lines += [
        "Notes:",
        "",
        f"- Load: the 1-minute load average at the cells' starts ranged {min(results.loads):.2f}-"
        f"{max(results.loads):.2f} (start of run {env['load_start']}, end {generated_docs.load()}); "
        f"{flagged} of {total} cells had more than {FOREIGN_FLAG} cores of foreign load. The machine has 2 "
        "cores, shared by wrk, the stub, the proxy and whatever else ran: throughput and latency figures "
        "carry that contention, CPU per request much less (each is the proxy's own time).",
        f"- Streams checked by the first-chunk client: {results.wrong_streams} wrong (status, model name, "
        f"{CHUNKS} chunks, `[DONE]`); each target's non-streaming answer was checked once before the rounds. "
        "wrk counts errors as socket errors, timeouts and non-2xx answers.",
        "- wrk stops at the end of a cell with requests in flight: their CPU is in the cell, they are not in "
        "its count (at c256 a few % of a cell's requests; alike for every target).",
        f"- Direct, vllm-router and nginx send the versioned name (`{env['versioned']}`) to the stub; kvgate "
        f"gets the logical ID `{LOGICAL_ID}` and rewrites it both ways, so the stub does the same work.",
        "- kvgate: `kvgate serve --workers 1` (one process) and `kvgate serve --workers 2` (a parent and two "
        "workers on one listening socket, docs/workers.md), each with its own embedded redis-server in its "
        "process tree (the same version published in both). nginx: `worker_processes 1`, upstream "
        "`keepalive 256`, "
        f"`proxy_buffering off` (master and worker summed). vllm-router ({env['vllm-router']}): "
        "`--policy round_robin`, the stub as its only worker; one process, all its threads.",
        f"- Machine: {env['machine']}. wrk: {env['wrk']}. nginx: {env['nginx']}.",
    ]
    if profile is not None and args.profile is not None:
        lines += ["", *profile_table(profile, args.profile.name)]
    return "\n".join(lines) + "\n"


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


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.proxy_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--seconds", type=int, default=4, help="wrk's duration of one cell (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured wrk seconds per target and kind")
    parser.add_argument("--streams", type=int, default=100, help="streams a round for the first-chunk client")
    parser.add_argument("--vllm-router", type=Path, default=Path(".venv-router/bin/vllm-router"),
                        help="vllm-router command, relative to the repository root unless absolute; "
                        "skipped if missing (default .venv-router/bin/vllm-router)")  # fmt: skip
    parser.add_argument("--out", default="docs/perf.md", help="markdown report ('-': print only)")
    parser.add_argument("--profile", type=Path, metavar="BASE", help="after the rounds, py-spy kvgate "
                        "under c64 plain load: BASE.svg (flame graph) and BASE.txt (summary)")  # fmt: skip
    parser.add_argument("--profile-seconds", type=int, default=10, help="seconds of each py-spy recording")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0 or args.streams < 1:
        parser.error("--rounds, --seconds and --streams must be positive")
    if args.profile is not None and not args.profile.is_absolute():
        args.profile = ROOT / args.profile
    return args


def _version(argv: Sequence[str]) -> str:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        text = (done.stdout + done.stderr).strip().splitlines()
        return text[0] if text else "?"
    return "?"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    if shutil.which("wrk") is None:
        print(
            "proxy_overhead: no `wrk` on PATH (`apt-get install wrk`; make loadtest-proxy does)",
            file=sys.stderr,
        )
        return 1
    env = {
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}",
        "load_start": _load_average(),
        "wrk": _version(["wrk", "--version"]).split(" Copyright")[0],
        "nginx": "not installed (skipped)",
        "vllm-router": "not installed (skipped)",
    }
    py = sys.executable
    started = time.monotonic()
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

                versioned = str(publish(workdir)["name"])
                env["versioned"] = versioned
                targets = [Target("direct", stub_url, versioned, versioned, None)]
                for name, workers in (("kvgate", 1), ("kvgate-2", 2)):
                    if name != "kvgate":
                        fleet.callback(stop_leftover_redis, workdir, name)
                        publish(workdir, name)
                    kv_port = free_port()
                    kvgate = fleet.start(name, [py, "-m", "gateway.cli", "serve", "--replica", stub_url,
                                                "--data-dir", str(workdir / name),
                                                "--store", str(workdir / "store"), "--workers", str(workers),
                                                "--port", str(kv_port)])  # fmt: skip
                    kv_url = f"http://127.0.0.1:{kv_port}"
                    wait_ready(kvgate, kv_url + "/healthz")
                    targets.append(Target(name, kv_url, LOGICAL_ID, LOGICAL_ID, kvgate))
                router_binary = ROOT / args.vllm_router  # an absolute path stays as it is
                if router_binary.is_file() and os.access(router_binary, os.X_OK):
                    router, router_url = start_vllm_router(fleet, router_binary, stub_url)
                    wait_ready(router, router_url + "/health", timeout=60.0)
                    targets.append(Target("vllm-router", router_url, versioned, versioned, router))
                    env["vllm-router"] = router_version(router_binary)
                else:
                    print(f"vllm-router: not installed (no {router_binary}): skipped", flush=True)
                nginx_binary = shutil.which("nginx")
                if nginx_binary is not None:
                    nginx, nginx_url = start_nginx(fleet, nginx_binary, stub_port)
                    wait_ready(nginx, nginx_url + "/v1/models")
                    targets.append(Target("nginx", nginx_url, versioned, versioned, nginx))
                    env["nginx"] = _version([nginx_binary, "-v"]).removeprefix("nginx version: ")
                else:
                    print("nginx: not installed (no `nginx` on PATH): skipped", flush=True)
                # kvgate first in the warm-up: its first request loads the adapter into the stub
                targets.insert(0, targets.pop(1))
                print(f"targets: {', '.join(t.name for t in targets)}; published {versioned}", flush=True)
                results = bench(targets, stub, workdir, args)
                results.targets.sort(key=lambda t: list(LABELS).index(t.name))
                summary = None
                if args.profile is not None:
                    kv_target = next(t for t in targets if t.name == "kvgate")
                    script = wrk_script(workdir, kv_target, "plain")
                    summary = profile_kvgate(kv_target, stub, script, args.profile, args.profile_seconds)
        except RuntimeError as exc:
            print(f"proxy_overhead: {exc}", file=sys.stderr)
            return 1
    report = render(results, args, env, summary)
    print()
    print(report)
    if summary is not None:
        print(f"py-spy profile of kvgate: {args.profile}.svg, {args.profile}.txt\n{summary.render(top=15)}")
    print(f"run took {time.monotonic() - started:.0f} s")
    if args.out != "-":
        out = Path(args.out)
        generated_docs.write_report(out if out.is_absolute() else ROOT / out, report)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
