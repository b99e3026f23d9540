"""Property tests of the public API (hypothesis): whatever the body, headers, method and path, kvgate never
answers 500, every error is an OpenAI-style JSON body, nothing is logged as a traceback, and ``/healthz``
still answers.

kvgate runs in-process (one stub replica, the real Redis) on the test's event loop; hypothesis drives it
from a worker thread with ``http.client``, which sends header values as raw bytes (non-UTF-8 included).
Derandomized and without an example database: nothing is written into the tree, and a run draws the same
examples every time for the same selection of tests (Hypothesis also draws constants from the project's
modules that are loaded, so ``make test`` runs one fixed sequence and this file alone another).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

# Hypothesis keeps caches (constants, Unicode tables) in ./.hypothesis unless told otherwise; read at its
# first use, which is after this line.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "kvgate-hypothesis")
)

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from tests.support.adapter_files import MakeAdapter
from tests.support.edge import ADMIN_TOKEN, LOGICAL_ID, assert_openai_error, kvgate
from tests.support.serve_modes import serve_shape  # noqa: F401  (autouse: every test here runs in both shapes)

EXAMPLES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/kvgate/status"]

models = st.sampled_from([LOGICAL_ID, "base", "unknown", f"{LOGICAL_ID}\n", f"{LOGICAL_ID}@0123456789abcdef"])
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.integers(0, 2**63), max_size=300),
    st.lists(st.lists(st.integers(-5, 150_000), max_size=20), max_size=5),
    json_values,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"])},
            optional={"content": st.one_of(st.text(max_size=200), json_values)},
        ),
        max_size=4,
    ),
    json_values,
)
request_objects = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(models, json_values),
        "prompt": prompts,
        "messages": messages,
        "stream": st.one_of(st.sampled_from([True, False, "true", "false", "1", "yes", 1, 0]), json_values),
        "cache_salt": st.one_of(st.text(max_size=10), json_values),
        "extra_key": json_values,
        "max_tokens": json_values,
        "n": json_values,
    },
).flatmap(lambda fields: st.dictionaries(st.text(max_size=6), json_values, max_size=3).map(fields.__or__))


def nest(depth: int) -> bytes:
    return b'{"model":"base","prompt":' + b"[" * depth + b"]" * depth + b"}"


bodies = st.one_of(
    request_objects.map(lambda doc: json.dumps(doc).encode()),
    json_values.map(lambda doc: json.dumps(doc).encode()),
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.integers(1, 3000).map(nest),
    st.just(b"\xef\xbb\xbf{}"),  # a BOM
)
field_bytes = st.binary(max_size=40).map(
    lambda raw: bytes(b for b in raw if b == 0x09 or 0x20 <= b != 0x7F)  # what HTTP allows in a field value
)
header_values = st.one_of(
    field_bytes,
    st.sampled_from([ADMIN_TOKEN.encode(), b"cold", b"warm", b"application/json", b"text/plain", b"gzip"]),
)
header_names = st.one_of(
    st.sampled_from(
        [
            "x-kvgate-admin-token",
            "x-kvgate-pin",
            "x-kvgate-namespace",
            "Content-Type",
            "Authorization",
            "Accept",
            "Content-Encoding",
            "x-kvgate-version",
            "traceparent",
        ]
    ),
    st.text("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~", min_size=1, max_size=12),
)
# Headers that frame the HTTP message itself: a wrong one is refused by the HTTP parser before kvgate's
# application sees the request (a plain-text 400 from aiohttp, tested on its own in test_error_boundary).
FRAMING = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "expect", "te", "trailer"}
headers = st.dictionaries(
    header_names.map(str.lower).filter(lambda name: name not in FRAMING), header_values, max_size=4
)
paths = st.one_of(
    st.sampled_from(ROUTES),
    st.text(max_size=30).map(lambda text: "/" + quote(text, safe="/?=&%")),
    st.sampled_from(ROUTES).flatmap(lambda route: st.text(max_size=10).map(lambda q: f"{route}?{quote(q)}")),
)
methods = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


def exchange(host: str, port: int, method: str, path: str, head: dict[str, bytes], body: bytes) -> None:
    """One request; the answer must never be a 500, and an error must be an OpenAI-style JSON body."""
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in head.items():
            if name.lower() != "content-length":
                connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        payload = response.read()
    finally:
        connection.close()
    assert response.status != 500, payload[:500]
    assert response.status < 500 or response.status in {502, 503, 504}, payload[:500]
    if response.status >= 400 and method != "HEAD":
        assert_openai_error(response.getheader("Content-Type", ""), payload, response.status)


async def test_no_request_gets_a_500_or_a_non_json_error_and_kvgate_stays_up(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        parts = urlsplit(edge.url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80

        @EXAMPLES
        @given(method=methods, path=paths, head=headers, body=bodies)
        def any_request(method: str, path: str, head: dict[str, bytes], body: bytes) -> None:
            exchange(host, port, method, path, head, body)

        @EXAMPLES
        @given(route=st.sampled_from(ROUTES[:2]), head=headers, body=bodies)
        def any_body_on_the_api(route: str, head: dict[str, bytes], body: bytes) -> None:
            exchange(host, port, "POST", route, head, body)

        await asyncio.to_thread(any_request)
        await asyncio.to_thread(any_body_on_the_api)
        health = await asyncio.to_thread(_get, host, port, "/healthz")
    assert health[0] == 200, health
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert tracebacks == []
    assert edge.stub.received, "some requests reached the replica (the strategies are not all refusals)"


def _get(host: str, port: int, path: str) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()
