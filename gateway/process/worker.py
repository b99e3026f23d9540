"""``python -m gateway.process.worker``: one worker of ``kvgate serve --workers N``, started by its parent
(``gateway/process/parent.py``) with the parent's ``serve`` arguments after ``--`` and its listening sockets
as inherited descriptors. Not a command for people: ``kvgate serve`` starts it.

It reads its settings exactly as its parent did (the same arguments, environment and config file), takes
the parent's embedded Redis by its socket and a gateway id of its own (``parent.for_worker``), and dies
with its parent (Linux ``PR_SET_PDEATHSIG``: SIGKILL), even when the parent is killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import uvloop

from gateway.cli.main import build_parser, serve, settings_from
from gateway.core.errors import KvgateError
from gateway.process.parent import WorkerPlace, for_worker
from gateway.process.siblings import Siblings
from gateway.telemetry.tracing import tracer_provider_from_env

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int) -> None:
    """SIGKILL to this process when its parent dies (a kvgate killed is killed whole, as one process is:
    its embedded Redis is gone too); exit now if the parent already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)


def _inherited(fd: int | None) -> socket.socket | None:
    return None if fd is None else socket.socket(fileno=fd)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.process.worker", description=__doc__.splitlines()[0]
    )
    for name in ("--slot", "--count", "--restarts", "--parent", "--api-fd"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--admin-fd", type=int)
    parser.add_argument("--kv-index-fd", type=int, help="the shared KV index the parent's indexer writes")
    parser.add_argument("--ready-fd", type=int, help="written once serving: the parent knows it started")
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="-- then the parent's kvgate arguments")
    own = parser.parse_args(argv)
    _die_with(own.parent)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [worker {own.slot}]: %(message)s"
    )
    rest = own.serve[1:] if own.serve[:1] == ["--"] else own.serve
    args = build_parser().parse_args(rest)
    api = _inherited(own.api_fd)
    assert api is not None
    try:
        settings = for_worker(settings_from(args), own.slot)
        siblings = Siblings(settings.data_dir, own.slot, own.count, own.restarts)
        place = WorkerPlace(
            api, _inherited(own.admin_fd), siblings, ready_fd=own.ready_fd, kv_index_fd=own.kv_index_fd
        )
        tracing = tracer_provider_from_env()
        try:
            uvloop.run(serve(settings, tracing, place))
        finally:
            if tracing is not None:
                tracing.shutdown()
    except KvgateError as exc:
        print(f"kvgate worker {own.slot}: {exc.message}", file=sys.stderr)
        return 2 if exc.status < 500 else 1
    except (OSError, ValueError) as exc:
        print(f"kvgate worker {own.slot}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
