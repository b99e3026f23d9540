"""The object-store client (``obstore``'s S3 store) as kvgate opens it: configured from the usual
``AWS_*`` environment, every request under deadlines, and its errors told in one line."""

from __future__ import annotations

import datetime
import os
from typing import Any

from obstore.exceptions import BaseError
from obstore.store import S3Store

from gateway.core.errors import StoreUnavailable

SCHEMES = ("s3://",)
Client = S3Store
STALL_S = 10.0  # a request that gets no byte from the store for this long fails (retried within RETRY_S)
RETRY_S = 10.0  # no try starts after this long: a store that never answers fails in about STALL_S
REQUEST_S = 300.0  # a request not done within this fails, however it progresses


def is_object_url(location: str) -> bool:
    return location.startswith(SCHEMES)


def open_client(url: str, *, stall_s: float = STALL_S) -> Client:
    """An S3 client for ``s3://BUCKET[/PREFIX]``, configured from the environment, whose every request
    has deadlines: 5 s to connect, STALL_S without a byte from the store (a store that accepts and never
    answers, or stops mid-stream), REQUEST_S in all; retried at most twice, none started after RETRY_S.
    So a store that cannot be reached, or does not answer, fails in about 10 s, not the library's three
    minutes (or never)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
    allow_http = os.environ.get("AWS_ALLOW_HTTP", "").lower() in {"1", "true"} or endpoint.startswith("http:")
    retry: Any = {
        "max_retries": 2,
        "retry_timeout": datetime.timedelta(seconds=RETRY_S),
        "backoff": {
            "init_backoff": datetime.timedelta(milliseconds=100),
            "max_backoff": datetime.timedelta(seconds=2),
            "base": 2.0,
        },
    }
    options: Any = {
        "allow_http": allow_http,
        "connect_timeout": datetime.timedelta(seconds=5),
        "read_timeout": datetime.timedelta(seconds=stall_s),
        "timeout": datetime.timedelta(seconds=REQUEST_S),
    }
    try:
        return S3Store.from_url(
            url, client_options=options, retry_config=retry, copy_if_not_exists="multipart"
        )
    except BaseError as exc:
        raise StoreUnavailable(f"cannot open the object store {url}: {describe(exc)}") from None


def describe(exc: BaseException) -> str:
    """The client library's error in one line, led by how the call failed when that is known."""
    text = str(exc)
    line = (text.strip().splitlines() or [type(exc).__name__])[0][:300]
    if "kind: Timeout" in text:  # the library's debug source: a deadline of open_client's passed
        return f"timed out: {line}"  # the line says after how long
    if "ConnectionRefused" in text:
        return f"connection refused: {line}"
    return line
