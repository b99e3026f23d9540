"""The KV indexer process (``python -m gateway.process.indexer``), one per kvgate, and its keeper.

``kept_indexer`` runs in the process that owns the shared index file (``kv.shared_index.create``): the
workers' parent with ``--workers N``, the kvgate itself with one process. It starts the indexer with the
file's descriptor inherited, restarts it when it exits (the one backoff, ``tasks.backoff``; each
restart a new generation, whose table starts empty), and stops it (SIGTERM, then SIGKILL) when the block
ends. The indexer dies with its keeper (``PR_SET_PDEATHSIG``), runs below the workers' priority
(``NICENESS``: on a node short of cores the requests go first, and its lag shows it), and does the work
of ``kv.indexer.index_events``. Not a command for people: ``kvgate serve`` starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import uvloop

from gateway.kv.indexer import index_events
from gateway.tasks.backoff import Backoff

log = logging.getLogger(__name__)

NICENESS = 10  # below the workers: a core they want is mostly theirs; the indexer's lag shows it
STEADY_S = 30.0  # an indexer that lived this long was not crash-looping: restarted at once
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_WAIT_S = 5.0


def command(fd: int, replicas: Sequence[str], endpoints: Sequence[str], entries: int, page: Path,
            generation: int, failure_limit: float) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "gateway.process.indexer", "--fd", str(fd), "--entries", str(entries),
        "--page", str(page), "--generation", str(generation), "--parent", str(os.getpid()),
        "--failure-limit", str(failure_limit),
        *(f"--replica={url}" for url in replicas), *(f"--endpoint={e}" for e in endpoints),
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def kept_indexer(
    fd: int, replicas: Sequence[str], endpoints: Sequence[str], entries: int, page: Path,
    *, failure_limit: float,
) -> AsyncIterator[None]:  # fmt: skip
    """The indexer over the shared file ``fd``, restarted whenever it exits, while the block runs."""
    running: list[asyncio.subprocess.Process] = []

    async def keep() -> None:
        backoff, generation = Backoff(0.5, 5.0), 0
        while True:
            generation += 1
            began = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                *command(fd, replicas, endpoints, entries, page, generation, failure_limit),
                pass_fds=[fd], stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            running[:] = [process]
            log.info("KV indexer started (pid %d, generation %d)", process.pid, generation)
            code = await process.wait()
            if time.monotonic() - began >= STEADY_S:
                backoff.reset()
            wait = backoff.next()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
            log.warning("KV indexer (pid %d) exited with %s; restarting it in %.1f s", process.pid, how, wait)
            await asyncio.sleep(wait)

    task = asyncio.ensure_future(keep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for process in running:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), STOP_WAIT_S)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):  # it may end between the two
                        process.kill()
                    await process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(page)


def _die_with(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)


async def _run(own: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await index_events(
        own.fd, own.replica, own.endpoint, own.entries, own.page,
        generation=own.generation, failure_limit=own.failure_limit, stop=stop,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.process.indexer", description=__doc__.splitlines()[0]
    )
    for name in ("--fd", "--entries", "--generation", "--parent"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--failure-limit", type=float, required=True)
    parser.add_argument("--page", type=Path, required=True)
    parser.add_argument("--replica", action="append", default=[])
    parser.add_argument("--endpoint", action="append", default=[])
    own = parser.parse_args(argv)
    _die_with(own.parent)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [kv indexer]: %(message)s"
    )
    uvloop.run(_run(own))
    return 0


if __name__ == "__main__":
    sys.exit(main())
