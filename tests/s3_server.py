"""A real S3 API server for the object-store tests: moto's standalone server, one process per session.

Tests talk to it with the production client (``obstore``, through ``adapters.objstore``) configured by
the same ``AWS_*`` environment an operator sets; buckets are made with a plain ``PUT /BUCKET``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.serving import free_port


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
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{server.endpoint}/", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
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
