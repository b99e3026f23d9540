"""Start and stop real vLLM replicas (the CPU build) as child processes.

Each replica runs ``python -m vllm.entrypoints.openai.api_server`` in its own session (process group), with
runtime LoRA loading, prefix caching and per-request cache details switched on. ``stop`` ends the whole
group, so vLLM's engine-core children go with the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from gateway.core.errors import ReplicaStartError
from gateway.process.http_edge import free_port

_POLL_INTERVAL_S = 0.5
_PROBE_TIMEOUT_S = 5.0
_STOP_GRACE_S = 20.0
_LOG_TAIL_BYTES = 8192
_LOG_TAIL_LINES = 40


def kv_events_args() -> tuple[str, ...]:
    """vLLM's KV cache events on a port of its own (a wildcard endpoint: vLLM binds it, kvgate finds it at
    /kv_event_sources and follows it by default), with a replay socket."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
        "topic": "kv",
    }
    return ("--kv-events-config", json.dumps(config))


@dataclass(frozen=True)
class VllmReplicaSpec:
    """How to run one vLLM replica."""

    python: Path  # the .venv-vllm python
    model_dir: Path
    port: int
    log_path: Path
    served_name: str = "base"
    kv_cache_gib: int = 1
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1 (adds /reset_prefix_cache)
    max_lora_rank: int = 8
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_model_len: int = 1024
    # torch's threads in the engine (OMP_NUM_THREADS; None: torch's default, a thread per core). Two
    # replicas sharing 2 cores at the default spin against each other under load: 12 clients of chaos-like
    # completions got 2.1 answers/s at the default, 23 at one thread (loadtest.chaos runs at one).
    threads: int | None = None
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The command line that starts this replica."""
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(self.max_cpu_loras),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for this replica: ``base`` (default: this process's) plus vLLM's switches."""
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        else:
            env.pop("VLLM_SERVER_DEV_MODE", None)
        return env


def _log_tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _LOG_TAIL_BYTES))
            data = fh.read()
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


class VllmProcess:
    """One vLLM replica run as a child process group."""

    def __init__(self, spec: VllmReplicaSpec) -> None:
        self._spec = spec
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self._stopped = False

    @property
    def spec(self) -> VllmReplicaSpec:
        return self._spec

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._spec.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self, timeout: float = 600.0) -> None:  # noqa: ASYNC109 (the documented interface)
        """Spawn the replica and wait until ``GET /v1/models`` answers 200.

        Raises ``ReplicaStartError`` with the log tail if the process exits or does not
        answer within ``timeout`` seconds; the process group is stopped first. Cancelling also stops it.
        """
        if self._proc is not None:
            raise ReplicaStartError(f"replica on port {self._spec.port} was already started")
        spec = self._spec
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = spec.log_path.open("ab")  # a restart adds to the log: what came before stays
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *spec.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=self._log,
                stderr=asyncio.subprocess.STDOUT,
                env=spec.env(),
                start_new_session=True,
            )
        except BaseException:
            self._close_log()
            raise
        try:
            await self._wait_ready(time.monotonic() + timeout, timeout)
        except BaseException:
            await asyncio.shield(self.stop())
            raise

    async def _wait_ready(self, deadline: float, budget_s: float) -> None:
        proc = self._proc
        assert proc is not None
        probe_timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
        models_url = f"{self.url}/v1/models"
        exited = asyncio.ensure_future(proc.wait())  # one waiter for the whole start, not one per probe
        try:
            async with aiohttp.ClientSession(timeout=probe_timeout) as session:
                while True:
                    if proc.returncode is not None:
                        raise ReplicaStartError(
                            f"vLLM on port {self._spec.port} exited with code {proc.returncode} while "
                            f"starting; log {self._spec.log_path}:\n{_log_tail(self._spec.log_path)}"
                        )
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with session.get(models_url) as resp:
                            if resp.status == 200:
                                await resp.read()
                                return
                    if time.monotonic() >= deadline:
                        raise ReplicaStartError(
                            f"vLLM on port {self._spec.port} not ready after {budget_s:.0f}s; "
                            f"log {self._spec.log_path}:\n{_log_tail(self._spec.log_path)}"
                        )
                    await asyncio.wait([exited], timeout=_POLL_INTERVAL_S)  # early if the process exits
        finally:
            exited.cancel()

    async def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds; safe to call more than once."""
        proc = self._proc
        if proc is None or self._stopped:
            self._close_log()
            return
        self._stopped = True
        pgid = proc.pid  # start_new_session=True: the child leads its own group
        try:
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if proc.returncode is not None and not _group_alive(pgid):
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 0.2)
            _signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10.0)
        finally:
            self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def start_replicas(
    specs: Sequence[VllmReplicaSpec],
    timeout: float = 600.0,  # noqa: ASYNC109 (the documented interface)
) -> list[VllmProcess]:
    """Start all replicas concurrently; if any fails (or this is cancelled), stop all and re-raise."""
    procs = [VllmProcess(spec) for spec in specs]
    tasks = [asyncio.create_task(p.start(timeout)) for p in procs]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if not t.cancelled() and t.exception() is not None]
        if failed:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            exc = failed[0].exception()
            assert exc is not None
            raise exc
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        await asyncio.shield(asyncio.gather(*(p.stop() for p in procs), return_exceptions=True))
        raise
    return procs
