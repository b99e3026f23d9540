"""A real S3 API server for the object-store tests: moto's standalone server, one process per session.

Tests talk to it with the production client (``obstore``, through ``adapters.objstore``) configured by
the same ``AWS_*`` environment an operator sets; buckets are made with a plain ``PUT /BUCKET``. Two bad
endpoints, real sockets: ``silent_endpoint`` accepts connections and never answers; ``cutting_proxy``
forwards to a server until its clients have sent so many bytes, then drops every connection and refuses
new ones (a store that goes away mid-upload).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from gateway.process.http_edge import free_port


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path  # its access log: one line per request

    def environment(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "kvgate-test",
            "AWS_SECRET_ACCESS_KEY": "kvgate-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def new_bucket(self) -> str:
        name = f"kvgate-{secrets.token_hex(6)}"
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200, answer.status
        return name


def _moto_server() -> str:
    found = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    assert found, "moto_server is not installed beside this python: pip install -e '.[dev]'"
    return found


@contextmanager
def s3_server(log: Path) -> Iterator[S3Server]:
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [_moto_server(), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    server = S3Server(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:  # moto imports its S3 backend on the first request: seconds on a busy machine
                with urllib.request.urlopen(f"{server.endpoint}/", timeout=10):
                    break
            except OSError:  # refused, reset, a read timing out (URLError is one too)
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _listener() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)  # its accept loop sees the socket closed within this
    return sock


def _endpoint(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def silent_endpoint() -> Iterator[str]:
    """An endpoint URL whose server accepts every connection, reads nothing and never answers."""
    sock = _listener()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except TimeoutError:
                continue
            except OSError:  # closed: the block ended
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield _endpoint(sock)
    finally:
        sock.close()
        thread.join(timeout=5)
        for conn in held:
            conn.close()


@dataclass
class CuttingProxy:
    endpoint: str
    cut: threading.Event = field(default_factory=threading.Event)  # set once it dropped everything


@contextmanager
def cutting_proxy(upstream: str, *, after_bytes: int) -> Iterator[CuttingProxy]:
    """A TCP proxy to UPSTREAM (an http:// endpoint) that forwards both ways until its clients have sent
    AFTER_BYTES in all, then closes every connection and its listening socket: what was under way fails,
    and every later connection is refused."""
    target = urlsplit(upstream)
    sock = _listener()
    proxy = CuttingProxy(_endpoint(sock))
    conns: list[socket.socket] = []
    lock = threading.Lock()
    sent = 0

    def cut() -> None:
        proxy.cut.set()
        sock.close()
        with lock:
            for conn in conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def pump(src: socket.socket, dst: socket.socket, upward: bool) -> None:
        nonlocal sent
        try:
            while data := src.recv(1 << 16):
                if upward:
                    with lock:
                        sent += len(data)
                        over = sent >= after_bytes
                    if over:
                        cut()
                        return
                dst.sendall(data)
        except OSError:  # the other side, or the cut, closed it
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while not proxy.cut.is_set():
            try:
                client = sock.accept()[0]
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection((target.hostname, target.port or 80), timeout=10)
            server.settimeout(None)
            with lock:
                conns.extend([client, server])
            for src, dst, upward in ((client, server, True), (server, client, False)):
                threading.Thread(target=pump, args=(src, dst, upward), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        cut()
        thread.join(timeout=5)
