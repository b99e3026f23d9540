"""Pause a real vLLM replica's engine (SIGSTOP to its ``EngineCore`` process) while its API server answers:
a stream through it stays in flight, unfinished, for as long as a test needs, with no timing to hope on.

vLLM's API server answers ``/health``, ``/v1/models`` and ``/metrics`` without its engine, so kvgate keeps
seeing the replica healthy; anything that needs the engine (a token, a load or an unload) waits."""

from __future__ import annotations

import os
import signal
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
