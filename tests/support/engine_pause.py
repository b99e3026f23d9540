"""Slow a real vLLM replica's engine to a crawl, then hold it still (SIGSTOP) while its API server answers:
a stream through it stays in flight, unfinished, for as long as a test needs, with no timing to hope on.

vLLM 0.32's CPU build runs the API server, its ``VLLM::EngineCore`` (the scheduler) and, under the engine
core, the worker that runs the model (``MultiprocExecutor``). Both engine processes are stopped and
resumed together; the API server answers ``/health``, ``/v1/models`` and ``/metrics`` without them, so
kvgate keeps seeing the replica healthy, and sees a client leave (the API server sends the abort to the
engine core, which applies it when it runs again). Anything that needs the engine (a token, a load or an
unload) waits.

The signals come from a small process of their own (``_CYCLE``, at a higher priority), not from a thread
of the test process, so the cycle does not wait for the test process (its GIL, its turn on a busy
machine). Even so a run window stretches by the time the signals take, so a test that must see a
generation still running holds the engine (``hold``) as soon as it sees what it waits for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue  # the thread ended while we looked
            found += children
            todo += children
    return found


def _titled(pid: int, title: bytes) -> bool:
    try:
        return title in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes under a vLLM server: each ``VLLM::EngineCore`` and the processes under it (its
    worker) but resource trackers."""
    engines = []
    for core in (pid for pid in _descendants(server_pid) if _titled(pid, b"EngineCore")):
        engines += [core, *(pid for pid in _descendants(core) if not _titled(pid, b"resource_tracker"))]
    return engines


_CYCLE = """
import os, select, signal, sys, time
pids, run_s, period_s = [int(p) for p in sys.argv[1].split(",")], float(sys.argv[2]), float(sys.argv[3])
os.nice(-10)
def send(sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
send(signal.SIGSTOP)
print("cycling", flush=True)
while True:
    ready, _, _ = select.select([sys.stdin], [], [], period_s - run_s)
    if ready:
        line = sys.stdin.readline()
        if line == "hold\\n":
            print("held", flush=True)
            line = sys.stdin.readline()  # held until the test lets go
        send(signal.SIGCONT)
        break
    send(signal.SIGCONT)
    time.sleep(run_s)
    send(signal.SIGSTOP)
"""


RUN_S, PERIOD_S = 0.001, 0.2
"""1 ms of every 200: 1,000 tokens, about half a second of the fixture model's engine time, take well over
ten seconds, even with each run stretched by the time the signals take. At 5 ms of every 50 a 1,000-token
answer ended in about 3 s, before a test saw it begin (polling two replicas' ``/metrics``), before the
client's leaving reached vLLM, or before a kvgate that waited seconds for its Redis relayed the first
chunk (fresh-clone runs)."""


class EngineThrottle:
    """A real vLLM replica's engine slowed to a crawl, then held still: until ``hold``, a process of its own
    lets it run ``run_s`` of every ``period_s`` (SIGCONT, then SIGSTOP); ``hold`` stops it there; leaving
    the block resumes it. The fixture model makes about 2,000 tokens a second of engine time: a 1,000-token
    answer ends sooner than a busy test may react to it, unless slowed."""

    def __init__(self, server_pid: int | None, run_s: float = RUN_S, period_s: float = PERIOD_S) -> None:
        assert server_pid is not None, "the replica runs"
        self.run_s, self.period_s = run_s, period_s
        self.engines = engine_pids(server_pid)
        assert self.engines, f"no EngineCore process under vLLM server {server_pid}"
        self._cycler: subprocess.Popen[str] | None = None

    def hold(self) -> None:
        """Stop the engine and keep it stopped (until the block is left)."""
        cycler = self._running()
        assert cycler.stdin is not None
        assert cycler.stdout is not None
        cycler.stdin.write("hold\n")
        cycler.stdin.flush()
        assert cycler.stdout.readline() == "held\n", "the throttle holds the engine"

    def _running(self) -> subprocess.Popen[str]:
        assert self._cycler is not None, "the throttle runs (inside its with block)"
        return self._cycler

    def __enter__(self) -> EngineThrottle:
        pids = ",".join(map(str, self.engines))
        argv = [sys.executable, "-c", _CYCLE, pids, str(self.run_s), str(self.period_s)]
        self._cycler = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._cycler.stdout is not None
        assert self._cycler.stdout.readline() == "cycling\n", "the throttle started"  # the engine is slowed
        return self

    def __exit__(self, *exc: object) -> None:
        with self._running() as cycler:  # its pipes closed, waited for
            assert cycler.stdin is not None
            cycler.stdin.close()  # the cycler resumes the engine and ends
            cycler.wait(timeout=30)
        self._cycler = None
        for pid in self.engines:  # resumed whatever became of the cycler
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
