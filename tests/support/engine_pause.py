"""Pause a real vLLM replica's engine (SIGSTOP to its ``EngineCore`` process) while its API server answers:
a stream through it stays in flight, unfinished, for as long as a test needs, with no timing to hope on.

vLLM's API server answers ``/health``, ``/v1/models`` and ``/metrics`` without its engine, so kvgate keeps
seeing the replica healthy; anything that needs the engine (a token, a load or an unload) waits."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def engine_pids(server_pid: int) -> list[int]:
    """The engine-core processes under a vLLM server (titled ``VLLM::EngineCore`` by vLLM)."""
    engines = []
    for pid in _descendants(server_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"EngineCore" in title:
            engines.append(pid)
    return engines


@contextmanager
def paused_engine(server_pid: int | None) -> Iterator[None]:
    assert server_pid is not None, "the replica runs"
    engines = engine_pids(server_pid)
    assert engines, f"no EngineCore process under vLLM server {server_pid}"
    for pid in engines:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in engines:
            os.kill(pid, signal.SIGCONT)


class EngineThrottle:
    """A real vLLM replica's engine slowed to a crawl, then held still: until ``hold``, a thread lets it run
    ``RUN_S`` of every ``PERIOD_S`` (SIGCONT, then SIGSTOP); ``hold`` stops it there; leaving the block
    resumes it. A 1,000-token stream takes about a second on an idle engine, less than a busy test process
    may take to read its first chunk; slowed, it is still running when the test reacts to that chunk."""

    RUN_S, PERIOD_S = 0.005, 0.05

    def __init__(self, server_pid: int | None) -> None:
        assert server_pid is not None, "the replica runs"
        self.engines = engine_pids(server_pid)
        assert self.engines, f"no EngineCore process under vLLM server {server_pid}"
        self._held = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name="engine-throttle", daemon=True)

    def _signal(self, sig: signal.Signals) -> None:
        for pid in self.engines:
            os.kill(pid, sig)

    def _cycle(self) -> None:
        while not self._held.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(self.RUN_S)
            self._signal(signal.SIGSTOP)
            self._held.wait(self.PERIOD_S - self.RUN_S)

    def hold(self) -> None:
        """Stop the engine and keep it stopped (until the block is left)."""
        self._held.set()
        self._thread.join()
        self._signal(signal.SIGSTOP)

    def __enter__(self) -> EngineThrottle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._held.set()
        self._thread.join()
        self._signal(signal.SIGCONT)
