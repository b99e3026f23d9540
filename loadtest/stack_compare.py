"""HTTP stack candidates side by side under wrk (issue 19, item 3): a minimal proxy per stack
(``loadtest/stack_proxies.py``), kvgate itself and vllm-router, the same stub behind each.

The harness is ``loadtest.proxy_overhead``'s (the stub, wrk with a Lua body, CPU per request from each
proxy's process tree in /proc, foreign load): non-streaming requests and 32-chunk SSE streams at
concurrency 1 and 64, every target in every round one after the other, medians over rounds, ratios to
vllm-router taken within each round. The minimal proxies do only what every kvgate request must (read,
parse, rewrite ``model`` both ways on bytes, forward, relay): their CPU is the floor a stack sets.

Run from the repository root (``make loadtest-stacks`` installs granian; httptools is kvgate's)::

    .venv/bin/python -m loadtest.stack_compare [--rounds 2] [--seconds 3] [--out docs/perf.md] \\
        [--before DIR --before-label 'before (REV)']
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from gateway.dev import generated_docs
from gateway.process.http_edge import free_port
from loadtest.proxy_overhead import (
    CHUNKS,
    FOREIGN_FLAG,
    LOGICAL_ID,
    ROOT,
    Cell,
    Fleet,
    Target,
    publish,
    run_wrk,
    start_vllm_router,
    stop_leftover_redis,
    wait_ready,
    wrk_script,
)
from loadtest.stack_proxies import STACKS

LABELS = {
    "kvgate": "kvgate (`kvgate serve`, this tree)",
    "aiohttp": "aiohttp server + aiohttp client",
    "aiohttp-edge": "aiohttp server (kvgate's edge protocol) + aiohttp client",
    "aiohttp+htclient": "aiohttp server + httptools client",
    "httptools": "httptools server + httptools client (asyncio protocols)",
    "granian": "granian RSGI (Rust server, 1 worker) + aiohttp client",
    "vllm-router": "vllm-router (Rust, `round_robin`)",
}
CONCURRENCY = (1, 64)


BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from gateway.cli.main import main; sys.exit(main())"


def start_before(fleet: Fleet, workdir: Path, source: Path) -> Target:
    """``kvgate serve`` from the tree in ``source`` (``loadtest.edge``'s way), its version published, in
    front of a stub of its own: two kvgates on one replica, each with its own table, would each take
    the other's version of ``bench`` for a foreign copy and unload it."""
    workdir.mkdir()
    publish(workdir)
    stub_port = free_port()
    stub = fleet.start("stub-before", [sys.executable, "-m", "loadtest.stub_server", "--port", str(stub_port),
                                       "--chunks", str(CHUNKS)])  # fmt: skip
    stub_url = f"http://127.0.0.1:{stub_port}"
    wait_ready(stub, stub_url + "/v1/models")
    port = free_port()
    fleet.callback(stop_leftover_redis, workdir)  # runs after this kvgate has stopped
    child = fleet.start("kvgate-before", [sys.executable, "-c", BOOT, str(source), "serve",
                                          "--replica", stub_url, "--data-dir", str(workdir / "kvgate"),
                                          "--store", str(workdir / "store"),
                                          "--port", str(port)])  # fmt: skip
    wait_ready(child, f"http://127.0.0.1:{port}/healthz")
    return Target("kvgate-before", f"http://127.0.0.1:{port}", LOGICAL_ID, LOGICAL_ID, child)


def start_stack(fleet: Fleet, stack: str, upstream: str, versioned: str) -> tuple[Target, str]:
    port = free_port()
    py = sys.executable
    if stack == "granian":
        os.environ["STACK_UPSTREAM"], os.environ["STACK_VERSIONED"] = upstream, versioned
        granian = str(Path(py).parent / "granian")
        argv = [granian, "--interface", "rsgi", "--workers", "1", "--runtime-threads", "1",
                "--loop", "uvloop", "--no-ws", "--no-access-log", "--host", "127.0.0.1", "--port", str(port),
                "--backlog", "1024", "--factory", "loadtest.stack_proxies:granian_app"]  # fmt: skip
    else:
        argv = [py, "-m", "loadtest.stack_proxies", "--stack", stack, "--port", str(port),
                "--upstream", upstream, "--versioned", versioned]  # fmt: skip
    child = fleet.start(stack, argv)
    url = f"http://127.0.0.1:{port}"
    wait_ready(child, url + "/v1/models")
    return Target(stack, url, LOGICAL_ID, LOGICAL_ID, child), url


Cells = dict[tuple[str, str, int], list[Cell]]


def bench(targets: list[Target], stub: Target, workdir: Path, rounds: int, seconds: int) -> Cells:
    assert stub.proxy is not None
    cells: Cells = {}
    scripts = {(t.name, k): wrk_script(workdir, t, k) for t in targets for k in ("plain", "stream")}
    for target in targets:  # warm-up: kvgate's first request loads the adapter into the stub
        for kind in ("plain", "stream"):
            run_wrk(target, stub.proxy, scripts[target.name, kind], concurrency=8, seconds=1)
    for index in range(rounds):
        order = targets[index % len(targets) :] + targets[: index % len(targets)]
        for kind in ("plain", "stream"):
            for concurrency in CONCURRENCY:
                for target in order:
                    cell = run_wrk(
                        target,
                        stub.proxy,
                        scripts[target.name, kind],
                        concurrency=concurrency,
                        seconds=seconds,
                    )
                    cells.setdefault((target.name, kind, concurrency), []).append(cell)
                    print(f"round {index + 1} {kind} c{concurrency} {target.name}: {cell.rps():,.0f} req/s, "
                          f"{cell.cpu_us():,.0f} us/req, errors {cell.errors}, "
                          f"foreign {cell.foreign_cores:.2f}", flush=True)  # fmt: skip
    return cells


def render(
    cells: dict[tuple[str, str, int], list[Cell]], names: Sequence[str], rounds: int, seconds: int
) -> str:
    lines = [
        f"{rounds} rounds, wrk {seconds} s a cell (one thread, keep-alive, loopback), every target in each "
        "round; medians over rounds; ratios to vllm-router taken within each round, then their median. "
        f"A cell with more than {FOREIGN_FLAG} cores of foreign load is flagged ⚠.",
        "",
        "| kind | c | stack | req/s | CPU µs / request | ÷ vllm-router | p50 ms | errors | foreign cores |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in ("plain", "stream"):
        for concurrency in CONCURRENCY:
            router = cells.get(("vllm-router", kind, concurrency))
            for name in names:
                got = cells[(name, kind, concurrency)]
                ratio = "-"
                if router is not None and name != "vllm-router":
                    ratios = [a.cpu_us() / b.cpu_us() for a, b in zip(got, router, strict=True)]
                    ratio = f"{statistics.median(ratios):.2f}x"
                foreign = statistics.median(c.foreign_cores for c in got)
                lines.append(
                    f"| {kind} | {concurrency} | {LABELS[name]} | "
                    f"{statistics.median(c.rps() for c in got):,.0f} | "
                    f"{statistics.median(c.cpu_us() for c in got):,.0f} | {ratio} | "
                    f"{statistics.median(c.p50_ms for c in got):.2f} | {sum(c.errors for c in got)} | "
                    f"{foreign:.2f}{' ⚠' if foreign > FOREIGN_FLAG else ''} |"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--stacks", nargs="*", default=list(STACKS), choices=STACKS)
    parser.add_argument("--vllm-router", type=Path, default=Path(".venv-router/bin/vllm-router"))
    parser.add_argument("--before", type=Path, metavar="DIR", help="also measure kvgate from the tree in DIR")
    parser.add_argument("--before-label", default="before", help="its row's name")
    parser.add_argument("--out", default="-", help="markdown doc to write the block into ('-': print only)")
    args = parser.parse_args(argv)
    generated_docs.started_tree()
    if shutil.which("wrk") is None:
        print("stack_compare: no `wrk` on PATH (`apt-get install wrk`)", file=sys.stderr)
        return 1
    py = sys.executable
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvgate-stacks-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        fleet.callback(stop_leftover_redis, workdir)
        stub_port = free_port()
        stub_child = fleet.start("stub", [py, "-m", "loadtest.stub_server", "--port", str(stub_port),
                                          "--chunks", str(CHUNKS)])  # fmt: skip
        stub_url = f"http://127.0.0.1:{stub_port}"
        wait_ready(stub_child, stub_url + "/v1/models")
        stub = Target("direct", stub_url, "", "", stub_child)
        versioned = str(publish(workdir)["name"])
        kv_port = free_port()
        kvgate = fleet.start("kvgate", [py, "-m", "gateway.cli", "serve", "--replica", stub_url,
                                        "--data-dir", str(workdir / "kvgate"),
                                        "--store", str(workdir / "store"),
                                        "--port", str(kv_port)])  # fmt: skip
        wait_ready(kvgate, f"http://127.0.0.1:{kv_port}/healthz")
        targets = [Target("kvgate", f"http://127.0.0.1:{kv_port}", LOGICAL_ID, LOGICAL_ID, kvgate)]
        if args.before is not None:  # kvgate from another source tree, on its own data dir and version
            LABELS["kvgate-before"] = f"kvgate, {args.before_label}"
            targets.append(start_before(fleet, workdir / "before", args.before.resolve()))
        targets += [start_stack(fleet, stack, stub_url, versioned)[0] for stack in args.stacks]
        router_binary = ROOT / args.vllm_router
        if router_binary.is_file():
            router, router_url = start_vllm_router(fleet, router_binary, stub_url)
            wait_ready(router, router_url + "/health")
            targets.append(Target("vllm-router", router_url, versioned, versioned, router))
        cells = bench(targets, stub, workdir, args.rounds, args.seconds)
    report = render(cells, [t.name for t in targets], args.rounds, args.seconds)
    print(report)
    print(f"run took {time.monotonic() - started:.0f} s")
    if args.out != "-":
        generated_docs.write_block(ROOT / args.out, generated_docs.measured(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
