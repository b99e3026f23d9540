"""The vLLM-API stub (``tests.support.stub_backend``) as its own process, so its CPU is not the proxy's.

Run: ``python -m loadtest.stub_server --port P [--chunks 32]`` (on uvloop); stops on SIGTERM or SIGINT.
``--vllm-args MODEL [--port=N] [--served-model-name=NAME] [--stub-chunk-delay=S] ...`` takes vLLM's command
line (the rest of it ignored), serves NAME with MODEL as its root on every interface and, as vLLM, refuses
a load whose path holds no adapter: the stub replica image (deploy/image/stub) runs so, in place of ``vllm
serve``, in the containers and pods `make test` runs (tests/deploy/test_container_image.py,
tests/deploy/test_pods.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

import uvloop

from gateway.process.http_edge import running
from tests.support.stub_backend import StubState, build_stub


async def serve(port: int, chunks: int, host: str = "127.0.0.1", **state_fields: Any) -> None:
    state = StubState(chunks=chunks, **state_fields)
    app = build_stub(state)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with running(app, host=host, port=port):
        trim = asyncio.ensure_future(_trim_received(state, stop))
        await stop.wait()
        await trim


async def _trim_received(state: StubState, stop: asyncio.Event) -> None:
    """The stub records every body for tests; a long load test only needs to keep memory flat."""
    while not stop.is_set():
        del state.received[:]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=5.0)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vllm-args"]:
        vllm = argparse.ArgumentParser(prog="vllm serve (stub replica)")
        vllm.add_argument("model")
        vllm.add_argument("--port", type=int, default=8000)
        vllm.add_argument("--served-model-name", default=None)
        vllm.add_argument("--host", default="0.0.0.0")  # as vLLM: every interface
        vllm.add_argument("--stub-chunk-delay", type=float, default=0.0, help="seconds before each SSE chunk")
        known, _ = vllm.parse_known_args(argv[1:])
        name = known.served_model_name or known.model
        print(f"stub replica serving {name} ({known.model}) on port {known.port}", flush=True)
        fields = {"base": name, "base_root": known.model, "check_paths": True}
        uvloop.run(serve(known.port, 4, known.host, chunk_delay=known.stub_chunk_delay, **fields))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=32)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.chunks))  # as kvgate serve runs


if __name__ == "__main__":
    main()
