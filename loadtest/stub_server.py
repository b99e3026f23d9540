"""The vLLM-API stub (``tests.stub_backend``) as its own process, so its CPU is not the proxy's.

Run: ``python -m loadtest.stub_server --port P [--chunks 32]`` (on uvloop); stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import uvloop

from gateway.serving import running
from tests.stub_backend import StubState, build_stub


async def serve(port: int, chunks: int) -> None:
    state = StubState(chunks=chunks)
    app = build_stub(state)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(app, port=port):
        trim = asyncio.ensure_future(_trim_received(state, stop))
        await stop.wait()
        await trim


async def _trim_received(state: StubState, stop: asyncio.Event) -> None:
    """The stub records every body for tests; a long load test only needs to keep memory flat."""
    while not stop.is_set():
        del state.received[:]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=32)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.chunks))  # as kvgate serve runs


if __name__ == "__main__":
    main()
