"""What one heavy body costs kvgate's serving process: its CPU time per request, small and 4 MB side by side.

``loadtest/heavy_bodies.py`` measures what other clients feel; this measures the cause it points at: the
serving process's own CPU (user and system time of every thread, from ``/proc``) per request, while one
client sends requests one after another through ``kvgate serve --workers 1`` (predicted routing, two
stub replicas, embedded Redis; the helpers of ``loadtest/proxy_overhead.py``): small completions, then
each shape of ``heavy_bodies`` just under the 4 MiB body limit. The body lane's CPU (its own process) is
not counted: it is the work moved off the serving process. Each figure is the median over rounds.

Run from the repository root::

    .venv/bin/python -m loadtest.heavy_cost [--rounds 3] [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from gateway.process.http_edge import free_port
from loadtest.heavy_bodies import ADMIN_TOKEN, SHAPES, heavy_body, pinned, route, small_body
from loadtest.proxy_overhead import LOGICAL_ID, Fleet, publish, stop_leftover_redis, wait_ready

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system time of every thread of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def send(url: str, replica: str, shape: str, count: int) -> None:
    """``count`` requests of ``shape`` ("small" or a heavy shape) one after another, each answered 200."""
    body = small_body(LOGICAL_ID) if shape == "small" else heavy_body(shape)
    path = "/v1/completions" if shape == "small" else route(shape)
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            async with session.post(url + path, data=body, headers=pinned(replica)) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{shape}: {response.status} {await response.text()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.heavy_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--requests", type=int, default=40, help="heavy requests per shape and round")
    args = parser.parse_args(argv)
    shapes = ("small", *SHAPES)
    costs: dict[str, list[float]] = {shape: [] for shape in shapes}
    with tempfile.TemporaryDirectory(prefix="kvgate-heavy-cost-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir, stubs = Path(tmp), []
        for number in range(2):
            port = free_port()
            stub = fleet.start(
                f"stub-{number}", [sys.executable, "-m", "loadtest.stub_server", "--port", str(port)]
            )
            stubs.append(f"http://127.0.0.1:{port}")
            wait_ready(stub, stubs[-1] + "/v1/models")
        fleet.callback(stop_leftover_redis, workdir, "kvgate")
        publish(workdir, "kvgate")
        port = free_port()
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--data-dir", str(workdir / "kvgate"),
                "--store", str(workdir / "store"), "--port", str(port), "--workers", "1",
                "--admin-token", ADMIN_TOKEN, "--replica", stubs[0], "--replica", stubs[1]]  # fmt: skip
        kvgate = fleet.start("kvgate", argv)
        url = f"http://127.0.0.1:{port}"
        wait_ready(kvgate, url + "/healthz")
        pid = kvgate.process.pid
        asyncio.run(send(url, stubs[0], "small", 50))  # warm: the adapter loaded, the body lane started
        asyncio.run(send(url, stubs[0], "completion", 3))
        for _ in range(args.rounds):
            for shape in shapes:
                count = args.requests * 10 if shape == "small" else args.requests
                before = cpu_seconds(pid)
                asyncio.run(send(url, stubs[0], shape, count))
                costs[shape].append((cpu_seconds(pid) - before) / count * 1e3)
    small = statistics.median(costs["small"])
    print("| request | serving process CPU per request | over a small one |\n| --- | --- | --- |")
    for shape in shapes:
        cost = statistics.median(costs[shape])
        print(f"| {shape} | {cost:.2f} ms | {cost / small:.1f} x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
