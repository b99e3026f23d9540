"""Where kvgate's own CPU per request goes: the request path's stages timed inside ``kvgate serve``, and
the same app with its request path cut out, under the load of ``make loadtest-proxy``.

Three runs of ``kvgate serve`` (one process, the same stub, an adapter published as the current version of
``bench``, wrk at concurrency 64, non-streaming), CPU per request from its process tree as in
``proxy_overhead``:

- **kvgate**: as it is;
- **stages timed**: each stage of ``Proxy.handle`` wrapped in a ``perf_counter_ns`` timer (the timers cost a
  little; their sum is wall time inside the stages, which on a busy loop is close to their CPU);
- **app without the request path**: kvgate's whole app (edge protocol, error middleware, drain, routes)
  with ``Proxy.handle`` replaced by what ``loadtest/stack_proxies.py``'s minimal proxy does (read the body,
  rewrite ``model`` on the bytes, forward on kvgate's httptools client, relay): the framework's share.

Run from the repository root (a few minutes; ``make loadtest-stages`` writes docs/perf.md's block)::

    .venv/bin/python -m loadtest.stage_times [--seconds 4] [--rounds 2] [--out docs/perf.md]

``--serve MODE ...`` is internal: it is how this module starts the instrumented kvgate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest import proxy_overhead as po

MODES = {
    "kvgate": "kvgate (`kvgate serve`, one process)",
    "timed": "stages timed",
    "no-path": "app without the request path (a minimal handler)",
}
Timings = dict[str, list[int]]  # stage -> [nanoseconds, calls]


def _timed(timings: Timings, label: str, function: Callable[..., Any], coroutine: bool) -> Callable[..., Any]:
    def note(started: int) -> None:
        held = timings.setdefault(label, [0, 0])
        held[0] += time.perf_counter_ns() - started
        held[1] += 1

    if coroutine:

        @functools.wraps(function)
        async def waited(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return await function(*args, **kwargs)
            finally:
                note(started)

        return waited

    @functools.wraps(function)
    def called(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            note(started)

    return called


def _time_stages(timings: Timings) -> None:
    from gateway.fleet import reservation
    from gateway.request import auth, intake, placement, proxy, relay, stages

    timed: list[tuple[Any, str, str, bool]] = [
        (proxy.Proxy, "handle", "the whole request (wall, with its waits)", True),
        (auth.Auth, "caller", "1 authorize (the caller)", False),
        (intake.Intake, "parse", "2 parse (read the body, decode, admin headers)", True),
        (stages.Targeting, "resolve", "3 resolve (the snapshot)", False),
        (stages.Targeting, "split", "4 split (a rollout's version)", False),
        (stages.Targeting, "tokenize", "5 tokenize (salt, prefix keys, tokens)", False),
        (placement.Placement, "place", "6 decide: the scheduler, carried out (with the reservation)", True),
        (reservation.Reservation, "take", "6 decide: the reservation (lease)", True),
        (proxy, "upstream_body", "7 forward: the body spliced", False),
        (relay, "relay_body", "8 relay: read the answer, build the response", True),
        (relay, "transform", "8 relay: model rewritten back, usage read", False),
        (proxy.Proxy, "account", "9 account (metrics)", False),
    ]
    for owner, name, label, coroutine in timed:
        setattr(owner, name, _timed(timings, label, getattr(owner, name), coroutine))


def _cut_the_path(versioned: bytes) -> None:
    from aiohttp import web

    from gateway.request import proxy
    from gateway.request.routes import Route

    async def handle(self: proxy.Proxy, request: web.Request, route: Route) -> web.StreamResponse:
        body = (await request.read()).replace(b'"model": "bench"', b'"model": "' + versioned + b'"', 1)
        replica = self.pool.replicas[0]
        headers = {"Content-Type": "application/json"}
        answer = await self.upstream.request("POST", replica.url, route.path, body, headers)
        try:
            payload, status = await answer.read(), answer.status
        finally:
            answer.release()
        back = payload.replace(b'"model":"' + versioned + b'"', b'"model":"bench"')
        return web.Response(body=back, status=status, content_type="application/json")

    proxy.Proxy.handle = handle  # type: ignore[method-assign]


def serve(mode: str, out: Path, versioned: str, argv: list[str]) -> int:
    """kvgate, instrumented as ``mode`` says; the stage timings go to ``out`` (JSON) when it stops."""
    from gateway.cli.main import main

    timings: Timings = {}
    if mode == "timed":
        _time_stages(timings)
    elif mode == "no-path":
        _cut_the_path(versioned.encode())
    try:
        return main(argv)
    finally:
        out.write_text(json.dumps(timings))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    result: dict[str, Any] = {"cpu": {mode: [] for mode in MODES}, "stages": {}, "foreign": []}
    with tempfile.TemporaryDirectory(prefix="kvgate-stages-") as tmp, po.Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        fleet.callback(po.stop_leftover_redis, workdir)
        stub_port = free_port()
        stub = fleet.start("stub", [py, "-m", "loadtest.stub_server", "--port", str(stub_port)])
        stub_url = f"http://127.0.0.1:{stub_port}"
        po.wait_ready(stub, stub_url + "/v1/models")
        versioned = str(po.publish(workdir)["name"])
        targets: dict[str, po.Target] = {}
        for mode in MODES:
            port = free_port()
            argv = ["serve", "--replica", stub_url, "--data-dir", str(workdir / mode),
                    "--store", str(workdir / "store"), "--workers", "1", "--port", str(port)]  # fmt: skip
            if mode != "kvgate":  # the same Redis (embedded by the first), the same published version
                argv += ["--redis-url", f"unix://{workdir / 'kvgate' / 'redis' / 'redis.sock'}"]  # publish's
            launcher = [py, "-m", "loadtest.stage_times", "--serve", mode, str(workdir / f"{mode}.json"),
                        versioned, "--", *argv]  # fmt: skip
            child = fleet.start(mode, launcher)
            url = f"http://127.0.0.1:{port}"
            po.wait_ready(child, url + "/healthz")
            targets[mode] = po.Target(mode, url, po.LOGICAL_ID, po.LOGICAL_ID, child)
            po.check_plain(targets[mode])
        for _ in range(args.rounds):
            for mode, target in targets.items():
                script = po.wrk_script(workdir, target, "plain")
                cell = po.run_wrk(target, stub, script, concurrency=64, seconds=args.seconds)
                result["cpu"][mode].append(cell.cpu_us())
                result["foreign"].append(cell.foreign_cores)
                print(f"{MODES[mode]}: {cell.rps():,.0f} req/s, {cell.cpu_us():.0f} µs CPU a request, "
                      f"foreign {cell.foreign_cores:.2f} cores", flush=True)  # fmt: skip
        targets["timed"].proxy.stop()  # type: ignore[union-attr]  # it writes its timings as it stops
        timings = json.loads((workdir / "timed.json").read_text())
        requests = timings.get("the whole request (wall, with its waits)", [0, 1])[1] or 1
        result["stages"] = {label: ns / requests / 1000 for label, (ns, _) in timings.items()}
    return result


WHOLE = "the whole request (wall, with its waits)"


def render(result: dict[str, Any], rounds: int) -> str:
    """The run as docs/perf.md shows it: CPU a request per mode, the request path's share, the stages."""
    cpu = result["cpu"]

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    path = [whole - bare for whole, bare in zip(cpu["kvgate"], cpu["no-path"], strict=True)]
    foreign = result["foreign"]
    stages = {label: micros for label, micros in result["stages"].items() if label != WHOLE}
    lines = [
        f"CPU µs a request at c64, median of {rounds} rounds (min-max):",
        *(f"  {label}: {spread(cpu[mode])}" for mode, label in MODES.items()),
        f"  kvgate's request path (kvgate - app without it, round by round): {spread(path)}, "
        f"{statistics.median(p / w for p, w in zip(path, cpu['kvgate'], strict=True)):.0%} of kvgate's",
        f"foreign load during the cells: median {statistics.median(foreign):.2f} cores, "
        f"max {max(foreign):.2f}",
        "",
        "µs a request inside each stage (stages timed):",
        *(f"  {label}: {micros:.1f}" for label, micros in sorted(stages.items())),
        f"  sum of the stages: {sum(stages.values()):.1f}",
        f"  {WHOLE}: {result['stages'].get(WHOLE, float('nan')):.1f}",
    ]
    return "```\n" + "\n".join(lines) + "\n```"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        mode, out, versioned, _, *rest = argv[1:]
        return serve(mode, Path(out), versioned, rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="-", help="markdown doc to write the block into ('-': print only)")
    args = parser.parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    os.chdir(po.ROOT)
    report = render(measure(args), args.rounds)
    print(report)
    if args.out != "-":
        generated_docs.write_block(po.ROOT / args.out, generated_docs.measured(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
