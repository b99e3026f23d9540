"""Do heavy bodies hold other clients? Small requests' p50/p99 idle and while 8 clients send 4 MB bodies.

Every server runs in its own process on loopback: two vLLM-API stubs (``loadtest/stub_server.py``; two, so
prefix keys and tokens decide something) and ``kvgate serve --workers 1`` (an adapter published through
``kvgate publish``, embedded Redis), started with the helpers of ``loadtest/proxy_overhead.py``. First
the stubs alone (``direct``: small requests to one, heavy bodies to the other): what the machine itself
does to the small requests when 8 clients move 4 MB bodies; then nginx where kvgate runs (a peer: one
worker that reads each body whole into memory and forwards it to the stub the pin header names); then
kvgate, twice, with precise routing off (the predicted index) and on (``--kv-events --tokenizer DIR``, the
fixture model's tokenizer and chat template; the stubs publish no events, which changes nothing here).
Small requests are pinned to one stub and the heavy bodies to the other (the admin pin header; every
stage still runs): the stub parses each body on its own event loop, and a small request queued there
behind a 4 MB parse would measure the stub. The heavy clients and the heavy bodies' stub stand for other
machines: on a small machine they run niced (``--others-nice``, 19 by default; 0 to compete with kvgate
for the cores as they come). The small requests' stub is not niced: it stands for the small requests'
replica, whose CPU the heavy load elsewhere does not take (niced with the load, as it was until
2026-12-04, it waited for a core behind the heavy clients, and so did every mode: the stubs alone
measured 2.3-2.8x idle, the machine's doing, not kvgate's).
With two CPUs or more (``--placement``, ``Placement``), processes are pinned. By default (``traffic``) the
small requests' side (this prober, their stub, kvgate's serving process or nginx) runs on the first CPU
and the heavy side (the heavy clients, their stub, kvgate's body lane) on the others: the heavy load's
processes stand for other machines, and a wake-up that crosses to a CPU busy with their kernel work waits
for that CPU's next tick, up to 4 ms here (``loadtest/sched_delays.py``; docs/edge-parsing.md), which the
small requests' own path then never does (nice does not help: this kernel preempts no copy in progress).
With ``proxy`` kvgate and its body lane (or nginx) run alone on the first CPU and every other process on
the others: every hop of a small request then crosses CPUs.

Each round, for each body shape, the same prober sends small completions one after another through kvgate
(for ``--seconds``) twice, side by side: on kvgate alone (idle), then while ``--clients`` clients in a
separate process send bodies of that shape just under kvgate's 4 MiB body limit, back to back (loaded).
The shapes: ``completion`` (a 4 MB prompt string), ``chat`` (many short messages), ``token-ids`` (a prompt
as a list of token ids, with a client ``cache_salt``: a body kvgate must serialize again). Each figure is the
median over rounds (the machine is shared and noisy: read the ratios, measured in the same run).

Run from the repository root (``make loadtest-heavy``)::

    .venv/bin/python -m loadtest.heavy_bodies [--rounds 3] [--clients 8] [--seconds 10] \
        [--tokenizer .cache/fixture/model] [--out docs/edge-parsing.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER
from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.proxy_overhead import (
    LOGICAL_ID,
    Fleet,
    publish,
    start_nginx,
    stop_leftover_redis,
    wait_ready,
)

BODY_LIMIT = 4 * 1024 * 1024  # kvgate's default max_body_bytes
BODY_SIZE = BODY_LIMIT - 1024
SHAPES = ("completion", "chat", "token-ids")
MODES = ("direct", "nginx", "predicted", "precise")
BASE = "base"  # the stubs' served model: what a request sent to a stub directly names
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from")
PACE = 0.01  # seconds between one small request's answer and the next request
ADMIN_TOKEN = "heavy-bodies-admin"
NGINX_HTTP = """\
    client_max_body_size {body_limit};
    client_body_buffer_size {body_limit};
    upstream small {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
    upstream heavy {{ server 127.0.0.1:{heavy_port}; keepalive 64; }}
    map $http_{pin} $replica {{ default small; "{heavy_url}" heavy; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://$replica;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
"""
"""A peer in kvgate's place: nginx reads each body whole into memory before it forwards it (as kvgate
does, which must read a body's start to route it), and sends a pinned request where the pin names."""


def small_body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "a small request " * 8, "max_tokens": 1}).encode()


def heavy_body(shape: str, size: int = BODY_SIZE, seed: int = 1, model: str = LOGICAL_ID) -> bytes:
    """A request of ``shape`` (``SHAPES``), ``size`` bytes at most and close to it."""
    rng = random.Random(seed)
    head: dict[str, object] = {"model": model, "max_tokens": 1, "temperature": 0.0}
    room = size - len(json.dumps(head)) - 64
    if shape == "completion":
        words: list[str] = []
        while room > 0:
            words.append(rng.choice(WORDS))
            room -= len(words[-1]) + 1
        return json.dumps({**head, "prompt": " ".join(words)}).encode()
    if shape == "chat":
        messages: list[dict[str, str]] = []
        while room > 0:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(10, 40)))
            messages.append({"role": ("user", "assistant")[len(messages) % 2], "content": text})
            room -= len(json.dumps(messages[-1])) + 2
        if messages[-1]["role"] == "assistant":
            messages.pop()
        return json.dumps({**head, "messages": messages}).encode()
    head["cache_salt"] = "client-chosen"
    tokens: list[int] = []
    while room > 0:
        tokens.append(rng.randrange(4000))
        room -= len(str(tokens[-1])) + 2
    return json.dumps({**head, "prompt": tokens}).encode()


def route(shape: str) -> str:
    return "/v1/chat/completions" if shape == "chat" else "/v1/completions"


# --- the heavy clients, in their own process ------------------------------------------------------


@dataclass
class Heavy:
    """What the heavy clients did in one phase (their process prints it as JSON)."""

    requests: int
    median_s: float
    errors: list[str]


def pinned(replica: str) -> dict[str, str]:
    """Headers that pin a request to ``replica`` (the admin header)."""
    return {"Content-Type": "application/json", PIN_HEADER: replica, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


async def send_heavy(url: str, shape: str, clients: int, replica: str, model: str) -> Heavy:
    """``clients`` clients sending ``shape`` bodies back to back until SIGTERM; what they did."""
    body = heavy_body(shape, model=model)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    latencies: list[float] = []
    errors: list[str] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)
    ) as session:

        async def client() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                async with session.post(url + route(shape), data=body, headers=pinned(replica)) as response:
                    answer = await response.read()
                latencies.append(time.perf_counter() - started)
                if response.status != 200 or f'"model":"{model}"'.encode() not in answer:
                    errors.append(f"{response.status} {answer[:200]!r}")
                if len(latencies) == 1:
                    print("first", flush=True)

        await asyncio.gather(*(client() for _ in range(clients)))
    return Heavy(len(latencies), statistics.median(latencies), errors)


# --- the prober -----------------------------------------------------------------------------------


@dataclass
class Phase:
    latencies_ms: list[float]
    errors: int

    def p(self, q: int) -> float:
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[q - 1]


async def small_requests(url: str, seconds: float, replica: str, model: str) -> Phase:
    """Small completions one after another (``PACE`` apart) for ``seconds``; each one's latency."""
    latencies: list[float] = []
    errors = 0
    headers, small = pinned(replica), small_body(model)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            started = time.perf_counter()
            async with session.post(url + "/v1/completions", data=small, headers=headers) as response:
                await response.read()
            latencies.append((time.perf_counter() - started) * 1e3)
            errors += response.status != 200
            await asyncio.sleep(PACE)
    return Phase(latencies, errors)


@dataclass
class Cell:
    idle: list[Phase]
    loaded: list[Phase]
    heavy: list[Heavy]


@dataclass
class Under:
    """What one mode measures: where small requests and heavy bodies go, the model they name, and the
    kvgate process (if any: its body lane runs with the heavy side)."""

    name: str
    small_url: str
    heavy_url: str
    model: str
    kvgate: int | None = None


PLACEMENTS = ("traffic", "proxy", "none")


@dataclass(frozen=True)
class Placement:
    """The CPUs each side runs on (empty: wherever the kernel puts it). ``proxy``: kvgate (its body lane
    too) or nginx alone on the first CPU, every other process on the others. ``traffic``: the small
    requests' side (the prober, their stub, kvgate's serving process, nginx) on the first CPU, the heavy
    side (the heavy clients, their stub, kvgate's body lane) on the others."""

    name: str
    proxy: frozenset[int]
    small: frozenset[int]
    heavy: frozenset[int]
    lane: frozenset[int]  # kvgate's body lane: with kvgate (proxy) or with the heavy side (traffic)

    @classmethod
    def of(cls, name: str) -> Placement:
        cpus = frozenset(os.sched_getaffinity(0))
        first = frozenset({min(cpus)})
        if name == "proxy":
            return cls(name, first, cpus - first, cpus - first, first)
        if name == "traffic":
            return cls(name, first, first, cpus - first, cpus - first)
        return cls(name, frozenset(), frozenset(), frozenset(), frozenset())

    def describe(self) -> str:
        def at(cpus: frozenset[int]) -> str:
            return "CPU " + ",".join(str(cpu) for cpu in sorted(cpus))

        if self.name == "proxy":
            return f"kvgate (its body lane too) or nginx on {at(self.proxy)}, the rest on {at(self.heavy)}"
        if self.name == "traffic":
            return (
                f"the small requests' side (the prober, their stub, kvgate's serving process, nginx) on "
                f"{at(self.small)}, the heavy side (the heavy clients, their stub, kvgate's body lane) on "
                f"{at(self.heavy)}"
            )
        return "no process pinned to a CPU"

    def place_lane(self, kvgate: int | None) -> None:
        """kvgate's body lane (started by its first large body, where kvgate runs) moved to ``lane``."""
        if kvgate is None or self.lane == self.proxy:
            return
        for child in Path(f"/proc/{kvgate}/task/{kvgate}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                os.sched_setaffinity(int(child), self.lane)


def loaded_phase(
    fleet: Fleet, under: Under, stubs: list[str], shape: str, args: argparse.Namespace, name: str
) -> tuple[Phase, Heavy]:
    """Small requests while the heavy clients (a child process) send ``shape`` bodies."""
    argv = [*niced(args), sys.executable, "-m", "loadtest.heavy_bodies", "--send", under.heavy_url,
            "--shape", shape, "--replica", stubs[1], "--model", under.model,
            "--clients", str(args.clients)]  # fmt: skip
    with pinned_to(args.place.heavy):
        sender = fleet.start(name, argv)
    deadline = time.monotonic() + 120
    while "first" not in sender.tail() and time.monotonic() < deadline:  # their bodies are arriving
        if sender.process.poll() is not None:
            raise RuntimeError(f"the heavy clients exited:\n{sender.tail()}")
        time.sleep(0.05)
    args.place.place_lane(under.kvgate)
    phase = asyncio.run(small_requests(under.small_url, args.seconds, stubs[0], under.model))
    sender.stop(grace=120)
    heavy = Heavy(**json.loads(sender.tail().strip().splitlines()[-1]))
    return phase, heavy


def bench(fleet: Fleet, under: Under, stubs: list[str], args: argparse.Namespace) -> dict[str, Cell]:
    cells = {shape: Cell([], [], []) for shape in args.shapes}
    asyncio.run(small_requests(under.small_url, 1.0, stubs[0], under.model))  # warm: adapter loaded
    for number in range(args.rounds):
        for shape in args.shapes:
            idle = asyncio.run(small_requests(under.small_url, args.seconds, stubs[0], under.model))
            loaded, heavy = loaded_phase(
                fleet, under, stubs, shape, args, f"heavy-{under.name}-{shape}-{number}"
            )
            cell = cells[shape]
            cell.idle.append(idle)
            cell.loaded.append(loaded)
            cell.heavy.append(heavy)
            print(f"  {under.name:9} {shape:10} round {number + 1}: "
                  f"idle p50 {idle.p(50):6.1f} p99 {idle.p(99):6.1f} ms; "
                  f"loaded p50 {loaded.p(50):6.1f} p99 {loaded.p(99):6.1f} ms; "
                  f"{heavy.requests} heavy requests (median {heavy.median_s:.2f} s), "
                  f"{len(heavy.errors)} errors {heavy.errors[:3]}", flush=True)  # fmt: skip
    return cells


def report(results: dict[str, dict[str, Cell]], args: argparse.Namespace) -> str:
    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    rows = [
        "| routing | body shape | idle p50 | loaded p50 | idle p99 | loaded p99 | p99 loaded / idle "
        "| p99 added | heavy requests (median s) | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, cells in results.items():
        for shape, cell in cells.items():
            pairs = list(zip(cell.idle, cell.loaded, strict=True))
            ratio = med([loaded.p(99) / idle.p(99) for idle, loaded in pairs])
            added = med([loaded.p(99) - idle.p(99) for idle, loaded in pairs])
            heavy = sum(h.requests for h in cell.heavy)
            errors = sum(len(h.errors) for h in cell.heavy) + sum(p.errors for p in cell.idle + cell.loaded)
            seconds = med([h.median_s for h in cell.heavy])
            idle50, idle99 = med([p.p(50) for p in cell.idle]), med([p.p(99) for p in cell.idle])
            loaded50, loaded99 = med([p.p(50) for p in cell.loaded]), med([p.p(99) for p in cell.loaded])
            rows.append(
                f"| {mode} | {shape} | {idle50:.1f} ms | {loaded50:.1f} ms | {idle99:.1f} ms "
                f"| {loaded99:.1f} ms | **{ratio:.2f} x** | {added:+.1f} ms "
                f"| {heavy} ({seconds:.2f} s) | {errors} |"
            )
    return "\n".join(rows)


def niced(args: argparse.Namespace) -> list[str]:
    """The heavy clients and their stub stand for other machines: niced, so that on this small machine
    what the prober sees is kvgate's doing rather than the scheduler sharing its cores among them."""
    return ["nice", "-n", str(args.others_nice)] if args.others_nice else []


@contextlib.contextmanager
def pinned_to(cpus: frozenset[int]) -> Iterator[None]:
    """Processes started inside run on ``cpus`` (none: where this one does)."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.heavy_bodies", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent heavy clients (default 8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length (default 10 s)")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokenizer", type=Path, default=Path(".cache/fixture/model"),
                        help="the base model directory precise routing tokenizes with")  # fmt: skip
    parser.add_argument(
        "--others-nice", type=int, default=19, help="the heavy clients' and their stub's niceness"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="traffic" if len(os.sched_getaffinity(0)) > 1 else "none",
        help="which CPUs each process runs on (Placement; default: traffic, with 2 CPUs or more)",
    )
    parser.add_argument("--nginx", default=shutil.which("nginx"), help="the nginx binary of the peer")
    parser.add_argument("--out", type=Path, help="write the figures into this doc's generated block")
    parser.add_argument("--send", help=argparse.SUPPRESS)  # the heavy clients' process: kvgate's URL
    parser.add_argument("--shape", choices=SHAPES, help=argparse.SUPPRESS)
    parser.add_argument("--replica", help=argparse.SUPPRESS)  # the stub the heavy bodies are pinned to
    parser.add_argument("--model", default=LOGICAL_ID, help=argparse.SUPPRESS)  # what they name
    args = parser.parse_args(argv)
    args.place = Placement.of("none" if args.send else args.placement)
    if min(args.rounds, args.clients) < 2 or args.seconds < 1:
        parser.error("--rounds and --clients must be 2 or more, --seconds 1 or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.send:
        print(
            json.dumps(
                asdict(asyncio.run(send_heavy(args.send, args.shape, args.clients, args.replica, args.model)))
            ),
            flush=True,
        )
        return 0
    if "nginx" in args.modes and not args.nginx:
        raise SystemExit("no nginx binary (make loadtest-heavy installs Debian's nginx-light): pass --nginx")
    if "precise" in args.modes and not (args.tokenizer / "tokenizer.json").is_file():
        raise SystemExit(f"{args.tokenizer} holds no tokenizer.json (make setup builds the fixture)")
    generated_docs.started_tree()  # the tree measured, taken before the run
    if args.place.small:  # the prober
        os.sched_setaffinity(0, args.place.small)
    py = sys.executable
    results: dict[str, dict[str, Cell]] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-heavy-") as tmp:
        workdir = Path(tmp)
        with Fleet(workdir) as fleet:
            stubs, ports = [], []
            for number in range(2):
                port = free_port()
                nice = niced(args) if number == 1 else []  # stub 0 answers the small requests
                stub_argv = [*nice, py, "-m", "loadtest.stub_server", "--port", str(port)]
                with pinned_to(args.place.heavy if number == 1 else args.place.small):
                    stub = fleet.start(f"stub-{number}", stub_argv)
                stubs.append(f"http://127.0.0.1:{port}")
                ports.append(port)
                wait_ready(stub, stubs[-1] + "/v1/models")
            for mode in args.modes:
                if mode == "direct":  # the stubs alone: what the machine does to the small requests
                    results[mode] = bench(fleet, Under(mode, stubs[0], stubs[1], BASE), stubs, args)
                    continue
                if mode == "nginx":  # a peer where kvgate runs
                    with pinned_to(args.place.proxy):
                        nginx, url = start_nginx(
                            fleet, args.nginx, ports[0], NGINX_HTTP, heavy_port=ports[1], heavy_url=stubs[1],
                            pin=PIN_HEADER.replace("-", "_"), body_limit=2 * BODY_LIMIT,
                        )  # fmt: skip
                    wait_ready(nginx, url + "/v1/models")
                    results[mode] = bench(fleet, Under(mode, url, url, BASE), stubs, args)
                    nginx.stop()
                    continue
                data = f"kvgate-{mode}"
                fleet.callback(stop_leftover_redis, workdir, data)  # runs after kvgate has stopped
                publish(workdir, data)
                port = free_port()
                flags = (
                    ["--kv-events", "--tokenizer", str(args.tokenizer.resolve())] if mode == "precise" else []
                )
                argv = [py, "-m", "gateway.cli", "serve", "--data-dir", str(workdir / data),
                        "--store", str(workdir / "store"), "--port", str(port),
                        "--workers", "1", "--admin-token", ADMIN_TOKEN, *flags]  # fmt: skip
                for stub_url in stubs:
                    argv += ["--replica", stub_url]
                with pinned_to(args.place.proxy):
                    kvgate = fleet.start(f"kvgate-{mode}", argv)
                url = f"http://127.0.0.1:{port}"
                wait_ready(kvgate, url + "/healthz")
                under = Under(mode, url, url, LOGICAL_ID, kvgate.process.pid)
                results[mode] = bench(fleet, under, stubs, args)
                kvgate.stop()
    text = report(results, args)
    print(text)
    if args.out is not None:
        sizes = ", ".join(f"{shape} {len(heavy_body(shape)):,}" for shape in args.shapes)
        generated_docs.write_block(args.out, generated_docs.measured(
            f"{args.clients} heavy clients back to back; small completions one after another for "
            f"{args.seconds:g} s a phase (idle, then loaded, per shape and round), {args.rounds} rounds; "
            f"the heavy clients and their stub at nice {args.others_nice}, the small requests' stub at 0; "
            f"{args.place.describe()}; "
            f"body bytes: {sizes}. Each figure is the "
            f"median over rounds; the ratio is each round's loaded p99 over its idle p99.\n\n{text}"
        ))  # fmt: skip
    errors = sum(len(h.errors) for cells in results.values() for c in cells.values() for h in c.heavy)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
