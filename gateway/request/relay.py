"""Moving bytes between a replica and a client: model names rewritten both ways, SSE relayed, usage read.

Coming out, the versioned name is rewritten back to the logical ID in the body and in every SSE line
(as bytes, no JSON parse; in an error body, wherever it appears: a client never sees a versioned
name it did not send), the evidence headers say which effective model answered, and the backend's
``usage`` numbers go to metrics and the span. ``UpstreamErrors`` is the one place upstream client errors
become kvgate errors.

Writing to the client and reading from the replica fail apart: a write to a client that left raises
``ClientClosed`` (the upstream response is closed, so the replica stops generating; the replica is not
blamed and nothing is retried), while a broken upstream read ends the stream with an SSE error event.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Protocol

import aiohttp
from aiohttp import web
from opentelemetry.trace import Span

from gateway.core.errors import (
    BackendTimeout,
    BackendUnreachable,
    BadRequest,
    ClientClosed,
    KvgateError,
    ModelNotFound,
    UpstreamError,
)
from gateway.core.model import Target
from gateway.telemetry import tracing as attr
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)
JSON = "application/json"


class Answer(Protocol):
    """A replica's answer as the relay reads it: ``upstream.Answer``, or aiohttp's (``AiohttpAnswer``)."""

    @property
    def status(self) -> int: ...
    @property
    def content_type(self) -> str: ...
    async def read(self) -> bytes: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class AiohttpAnswer:
    """aiohttp's response as an ``Answer`` (multipart and very large bodies go through aiohttp)."""

    __slots__ = ("response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str:
        return self.response.content_type

    async def read(self) -> bytes:
        return await self.response.read()

    def chunks(self) -> AsyncIterator[bytes]:
        return self.response.content.iter_any()

    def close(self) -> None:
        self.response.close()


_CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')


class Usage:
    """Reads ``usage`` numbers out of response bytes (no JSON parse) into metrics (under ``label``, from
    ``Metrics.for_id``) and the span, and keeps the last seen (``prompt``, ``cached``: None until an
    answer has them) for the account stage's live check (``kv.live_check``)."""

    __slots__ = ("cached", "label", "metrics", "prompt", "span")

    def __init__(self, metrics: Metrics, label: str, span: Span) -> None:
        self.metrics, self.label, self.span = metrics, label, span
        self.prompt: int | None = None
        self.cached: int | None = None

    def scan(self, data: bytes) -> None:
        if b'"usage"' not in data:
            return
        cached = _CACHED_TOKENS.search(data)
        prompt = _PROMPT_TOKENS.search(data)
        if prompt is not None:  # counted once an answer: a stream with continuous usage repeats it
            seen, self.prompt = self.prompt or 0, int(prompt.group(1))
            self.metrics.child(self.metrics.prompt_tokens, self.label).inc(max(0, self.prompt - seen))
        if cached is not None:
            seen, self.cached = self.cached or 0, int(cached.group(1))
            self.metrics.child(self.metrics.cached_tokens, self.label).inc(max(0, self.cached - seen))
            self.span.set_attribute(attr.CACHED_TOKENS, self.cached)


class ModelRewrite:
    """Rewrites the ``model`` field from the versioned name back to the logical ID, as bytes.

    Only the exact JSON member ``"model":"<versioned name>"`` (with or without a space) is touched,
    so generated text is never altered; versioned names are unique, so no parse is needed.
    """

    __slots__ = ("logical", "pairs", "versioned")

    def __init__(self, versioned: str, logical: str) -> None:
        self.versioned, self.logical = versioned.encode(), logical.encode()
        v, lg = json.dumps(versioned).encode(), json.dumps(logical).encode()
        self.pairs = ((b'"model":' + v, b'"model":' + lg), (b'"model": ' + v, b'"model": ' + lg))

    def apply(self, data: bytes) -> bytes:
        for old, new in self.pairs:
            if old in data:
                data = data.replace(old, new)
        return data

    def scrub(self, data: bytes) -> bytes:
        """An error body (no generated text in it): the versioned name becomes the logical ID everywhere."""
        return data.replace(self.versioned, self.logical)

    async def forgotten(self, upstream: Answer) -> bool:
        """Whether the replica answered that it does not have the versioned name (vLLM: 404, "The model
        `<name>` does not exist."): it restarted, or someone else unloaded it."""
        return upstream.status == 404 and self.versioned in await upstream.read()


@functools.lru_cache(maxsize=4096)
def model_rewrite(versioned: str, logical: str) -> ModelRewrite:
    return ModelRewrite(versioned, logical)


_VERSIONED_NAME = r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})@[0-9a-f]{16}"  # group 1: the logical ID
_ANY_NAME_TEXT = re.compile(_VERSIONED_NAME)


def public_message(message: str, replica_names: dict[str, str]) -> str:
    """An error message as a client may read it: every replica URL named as responses name it
    (``replica_names``: URL -> its id, or itself with ``expose_replica_urls``) and every versioned name
    as its logical ID (the client never sent one)."""
    for url in sorted(replica_names, key=len, reverse=True):  # a URL that prefixes another goes last
        if url in message:
            message = message.replace(url, replica_names[url])
    return _ANY_NAME_TEXT.sub(r"\1", message) if "@" in message else message


class AnyVersionRewrite:
    """Rewrites any versioned name in ``model`` back to its logical ID (``tenant-42@<16 hex>`` →
    ``tenant-42``): for answers whose effective model kvgate does not know in advance (a stored
    response fetched by its id)."""

    __slots__ = ()
    _VERSIONED = re.compile(rb'("model":\s?")' + _VERSIONED_NAME.encode() + rb'"')

    _ANY_NAME = re.compile(_VERSIONED_NAME.encode())

    def apply(self, data: bytes) -> bytes:
        return self._VERSIONED.sub(rb'\1\2"', data) if b"@" in data else data

    def scrub(self, data: bytes) -> bytes:
        """An error body: every versioned name becomes its logical ID."""
        return self._ANY_NAME.sub(rb"\1", data) if b"@" in data else data

    async def forgotten(self, upstream: Answer) -> bool:
        """No version is known in advance here, so none can be found forgotten."""
        return False


ANY_VERSION = AnyVersionRewrite()
Rewrite = ModelRewrite | AnyVersionRewrite


def model_card(payload: bytes, served: str, logical: str) -> dict[str, object] | None:
    """``/v1/models/{model}``: the card the replica lists for ``served``, under the caller's name for it
    (a version's ``root``, its store path, is the logical ID too), or None when it lists no such card."""
    try:
        listing = json.loads(payload)
        card = next(c for c in listing["data"] if isinstance(c, dict) and c.get("id") == served)
    except (ValueError, KeyError, TypeError, StopIteration):
        return None
    if served == logical:
        return dict(card)
    return {**card, "id": logical, "root": logical}


def openai_error(payload: bytes, status: int, replica: str) -> bytes | None:
    """A replica's error answer (``status`` >= 400) as kvgate relays it: None when its body is an
    OpenAI-style error (``{"error": {"message": ..., ...}}``: relayed, its versioned names scrubbed), else
    kvgate's own OpenAI-style body with the same status, saying no more than that (a proxy's plain-text
    413, an HTML 502, a framework's ``{"detail": ...}``: none of the replica's words reach the client)."""
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return None
    said = f"replica {replica} answered {status} without an OpenAI-style error body"
    own = BadRequest(said, code="upstream_error") if status < 500 else UpstreamError(said)
    own.status = status  # the replica's status, whatever its class: a 413 stays a 413
    log.warning("%s: %r", said, payload[:200])
    return own.json_bytes()


async def relay_body(
    upstream: Answer,
    rewrite: Rewrite | None,
    usage: Usage,
    headers: dict[str, str],
    replica: str,
) -> web.Response:
    """The replica's whole answer; ``replica``: its name in error messages."""
    payload = await upstream.read()
    if upstream.status >= 400:
        own = openai_error(payload, upstream.status, replica)
        if own is not None:
            return web.Response(body=own, status=upstream.status, headers=headers, content_type=JSON)
        if rewrite is not None:
            payload = rewrite.scrub(payload)
    response = web.Response(body=transform(payload, rewrite, usage), status=upstream.status, headers=headers)
    response.content_type = upstream.content_type
    return response


async def relay_card(
    upstream: Answer, served: str, target: Target, headers: dict[str, str], replica: str
) -> web.Response:
    """``/v1/models/{model}`` from the replica's listing (an error from it passes as ``relay_body``'s)."""
    payload = await upstream.read()
    if upstream.status >= 400:
        own = openai_error(payload, upstream.status, replica)
        body = own if own is not None else ANY_VERSION.scrub(payload)
        return web.Response(body=body, status=upstream.status, headers=headers, content_type=JSON)
    if upstream.status != 200:
        return web.Response(body=payload, status=upstream.status, headers=headers)
    card = model_card(payload, served, target.logical_id)
    if card is None:
        raise ModelNotFound(
            f"The model `{target.logical_id}` does not exist.", param="model", code="model_not_found"
        )
    return web.json_response(card, headers=headers)


async def relay_stream(
    request: web.Request,
    upstream: Answer,
    rewrite: Rewrite | None,
    usage: Usage,
    headers: dict[str, str],
    replica: str,
) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    to_client = _ClientWriter(request, response, upstream)
    await to_client.prepare()
    pending = b""  # an incomplete line: rewrites only ever see whole lines
    try:
        async for chunk in upstream.chunks():
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            if cut:
                await to_client.write(transform(data[:cut], rewrite, usage))
        if pending:
            await to_client.write(transform(pending, rewrite, usage))
    except (aiohttp.ClientError, TimeoutError) as exc:  # the replica's side (writes raise ClientClosed)
        # Bytes already went out: the status is sent, so the error travels as a final SSE event (in
        # kvgate's words: aiohttp's name the replica's address and its own internals; they go to the log).
        log.warning("the stream from replica %s broke off: %r", replica, exc)
        error = BackendUnreachable("the replica's stream broke off before its end")
        await to_client.write(b"data: " + error.json_bytes() + b"\n\n")
    await to_client.write_eof()
    return response


class _ClientWriter:
    """Writes to the client; a client that left becomes ``ClientClosed`` and closes the upstream response
    (the replica sees its connection close and stops generating)."""

    __slots__ = ("request", "response", "upstream")

    def __init__(self, request: web.Request, response: web.StreamResponse, upstream: Answer) -> None:
        self.request, self.response, self.upstream = request, response, upstream

    async def prepare(self) -> None:
        try:
            await self.response.prepare(self.request)
        except ConnectionError as exc:
            raise self._left() from exc

    async def write(self, data: bytes) -> None:
        try:  # per chunk: a try costs nothing, a context manager did
            await self.response.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one too
            raise self._left() from exc

    async def write_eof(self) -> None:
        try:
            await self.response.write_eof()
        except ConnectionError as exc:
            raise self._left() from exc

    def _left(self) -> ClientClosed:
        self.upstream.close()
        return ClientClosed("the client closed its connection mid-stream")


def transform(data: bytes, rewrite: Rewrite | None, usage: Usage) -> bytes:
    usage.scan(data)
    return rewrite.apply(data) if rewrite is not None else data


class UpstreamErrors:
    """The one place upstream client errors become kvgate errors (``replica_url``: the replica's name in
    responses, its id unless ``expose_replica_urls``). A class, not a generator: it is on every request."""

    __slots__ = ("replica_url",)

    def __init__(self, replica_url: str) -> None:
        self.replica_url = replica_url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, KvgateError):
            return
        if isinstance(exc, TimeoutError):
            raise BackendTimeout(f"replica {self.replica_url} timed out") from exc
        if isinstance(exc, aiohttp.ClientError):  # aiohttp's words (an address, its internals): the log only
            log.warning("replica %s is unreachable: %r", self.replica_url, exc)
            raise BackendUnreachable(f"replica {self.replica_url} is unreachable") from exc
