"""The OpenAI-compatible request path, in stages: parse → resolve (snapshot) → schedule → forward.

Going in, ``model`` is rewritten from the logical ID to the versioned name and the gateway sets the
cache namespace (the client's ``cache_salt`` is never forwarded). Coming out, the versioned name is
rewritten back to the logical ID in the body and in every SSE line, and headers say which effective
model answered: ``x-kvgate-version``, ``x-kvgate-digest``, ``x-kvgate-epoch``, ``x-kvgate-replica``.
No Redis command runs here: the snapshot is local. Each request leaves one span and its metrics.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from blake3 import blake3
from opentelemetry.trace import NoOpTracer, Span, SpanKind, StatusCode, Tracer

from gateway import tracing as attr
from gateway.backends import BackendDialect
from gateway.epoch_table import VersionState
from gateway.errors import (
    BackendTimeout,
    BackendUnreachable,
    BadRequest,
    BodyTooLarge,
    KvgateError,
    ModelNotFound,
    NoEligibleReplica,
    Unauthorized,
)
from gateway.loader import AdapterLoader
from gateway.metrics import UNKNOWN, Metrics
from gateway.prefix import PrefixIndex, block_keys, prompt_text
from gateway.replicas import Replica, ReplicaPool
from gateway.routing import Choice, choose, eligible, same_base
from gateway.snapshot import Snapshot

SALT_PREFIX = "kvg-"
VERSION_HEADER = "x-kvgate-version"
DIGEST_HEADER = "x-kvgate-digest"
EPOCH_HEADER = "x-kvgate-epoch"
REPLICA_HEADER = "x-kvgate-replica"
PREFIX_KEY_HEADER = "x-kvgate-prefix-key"
EVIDENCE_HEADERS = (VERSION_HEADER, DIGEST_HEADER, EPOCH_HEADER, REPLICA_HEADER, PREFIX_KEY_HEADER)
"""Response headers that say which effective model answered."""
PIN_HEADER = "x-kvgate-pin"
NAMESPACE_HEADER = "x-kvgate-namespace"  # "cold": a fresh, throwaway cache namespace (audits)
ADMIN_TOKEN_HEADER = "x-kvgate-admin-token"
CLIENT_NAMESPACE_FIELDS = ("cache_salt", "extra_key")  # vLLM's and SGLang's: never taken from a client
_CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    base_model: str
    base_identity: str
    base_with_root: bool
    max_body_bytes: int
    admin_token: str | None
    namespaces: bool  # set the gateway's cache namespace on requests (version-scoped invalidation)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    pin: Replica | None  # audits pin a request to one replica (admin token required)
    cold: bool  # audits ask for a fresh cache namespace (admin token required)


@dataclass(frozen=True, slots=True)
class Target:
    """The effective model a request meets: a published version, or the base model (version None)."""

    logical_id: str
    version: VersionState | None
    salt: str | None
    keys: list[bytes]  # prefix block keys, seeded by the cache namespace


def cache_salt(generation: str, version: VersionState) -> str:
    """The gateway's cache namespace for one effective model and epoch: fixed prefix, hex only."""
    key = f"{generation}\0{version.base}\0{version.digest}\0{version.epoch}".encode()
    return SALT_PREFIX + blake3(key).hexdigest()[:32]


class Proxy:
    def __init__(
        self,
        snapshot: Snapshot,
        pool: ReplicaPool,
        loader: AdapterLoader,
        dialect: BackendDialect,
        options: ProxyOptions,
        *,
        index: PrefixIndex,
        metrics: Metrics,
        tracer: Tracer,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.loader = loader
        self.dialect = dialect
        self.options = options
        self.index = index
        self.metrics = metrics
        self.tracer = tracer
        self.tracing = not isinstance(tracer, NoOpTracer)
        self.activity: dict[str, float] = {}
        """Logical ID -> monotonic time of its last request (the canary audits active IDs)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        label, outcome = UNKNOWN, "error"
        with self.tracer.start_as_current_span("kvgate.proxy", kind=SpanKind.SERVER) as span:
            try:
                parsed = await self.parse(request)
                target = self.resolve(parsed)
                label = target.logical_id
                if target.version is not None:
                    self.activity[label] = started
                _describe_target(span, request, target, self.dialect.name)
                response = await self.schedule_and_forward(request, parsed, target, span, started)
                outcome = str(response.status)
                return response
            except KvgateError as exc:
                outcome = exc.type
                span.set_status(StatusCode.ERROR, exc.message)
                raise
            finally:
                self.metrics.requests.labels(label, outcome).inc()
                self.metrics.latency.labels(label).observe(time.monotonic() - started)

    async def schedule_and_forward(
        self, request: web.Request, parsed: ParsedRequest, target: Target, span: Span, started: float
    ) -> web.StreamResponse:
        """Stages 3 and 4. A replica that fails before the first byte reaches the client is marked
        unhealthy (until its next good poll) and the request goes to the next eligible one; pinned
        requests are never moved. After the first byte, errors travel as a final SSE event instead."""
        for attempt in range(len(self.pool.replicas)):
            choice = await self.schedule(target, parsed.pin)
            _describe_choice(span, choice, target)
            self.metrics.routing.labels(choice.decision).inc()
            try:
                return await self.forward(request, parsed, target, choice.replica, span, started)
            except BackendUnreachable:
                choice.replica.healthy = False
                if parsed.pin is not None or attempt + 1 == len(self.pool.replicas):
                    raise
                self.metrics.routing.labels("retry").inc()
        raise NoEligibleReplica("no replica left to try")

    # --- stage 1: parse --------------------------------------------------------------------------

    async def parse(self, request: web.Request) -> ParsedRequest:
        limit = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit") from exc
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("you must provide a model parameter", param="model")
        pin, cold = self._admin_options(request)
        return ParsedRequest(body, raw, model, stream=body.get("stream") is True, pin=pin, cold=cold)

    def check_admin(self, request: web.Request) -> None:
        """The admin surface: off without a configured token, and a constant-time token check."""
        token, expected = request.headers.get(ADMIN_TOKEN_HEADER, ""), self.options.admin_token
        if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
            raise Unauthorized(
                f"this needs a valid {ADMIN_TOKEN_HEADER} (and kvgate started with an admin token)"
            )

    def _admin_options(self, request: web.Request) -> tuple[Replica | None, bool]:
        pin_url = request.headers.get(PIN_HEADER)
        cold = request.headers.get(NAMESPACE_HEADER) == "cold"
        if pin_url is None and not cold:
            return None, False
        self.check_admin(request)
        if pin_url is None:
            return None, cold
        for replica in self.pool.replicas:
            if replica.url == pin_url.rstrip("/"):
                return replica, cold
        raise BadRequest(f"{PIN_HEADER}: {pin_url!r} is not one of this pool's replicas")

    # --- stage 2: resolve ------------------------------------------------------------------------

    def resolve(self, parsed: ParsedRequest) -> Target:
        if parsed.model == self.options.base_model:
            return Target(parsed.model, None, None, [])
        version = self.snapshot.get(parsed.model)
        if version is None:
            raise ModelNotFound(
                f"The model `{parsed.model}` does not exist.", param="model", code="model_not_found"
            )
        if parsed.cold:
            return Target(parsed.model, version, f"{SALT_PREFIX}cold-{secrets.token_hex(16)}", [])
        salt = cache_salt(self.snapshot.generation, version)
        return Target(parsed.model, version, salt, block_keys(salt, prompt_text(parsed.body)))

    # --- stage 3: schedule -----------------------------------------------------------------------

    async def schedule(self, target: Target, pin: Replica | None) -> Choice:
        opts = self.options
        if target.version is None:
            candidates = same_base(self.pool.replicas, opts.base_identity, with_root=opts.base_with_root)
        else:
            candidates = eligible(self.pool.replicas, target.version, with_root=opts.base_with_root)
        if pin is not None:
            candidates = [replica for replica in candidates if replica is pin]
            if candidates:
                return Choice(pin, "pinned", self.index.matched(target.keys, pin.url))
        if candidates:
            return choose(candidates, target.keys, self.index)
        if target.version is None:
            raise NoEligibleReplica(f"no healthy replica serves base model {opts.base_model!r}")
        return Choice(await self.loader.ensure_loaded(target.version, on=pin), "loaded")

    # --- stage 4: forward ------------------------------------------------------------------------

    def upstream_body(self, parsed: ParsedRequest, target: Target) -> bytes:
        if target.version is None and not any(field in parsed.body for field in CLIENT_NAMESPACE_FIELDS):
            return parsed.raw
        body = dict(parsed.body)
        for field in CLIENT_NAMESPACE_FIELDS:  # a client never chooses a cache namespace
            body.pop(field, None)
        if target.version is not None:
            body["model"] = target.version.name
            if target.salt is not None and self.options.namespaces:
                self.dialect.set_cache_namespace(body, target.salt)
        return json.dumps(body, separators=(",", ":")).encode()

    async def forward(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        target: Target,
        replica: Replica,
        span: Span,
        started: float,
    ) -> web.StreamResponse:
        name = target.version.name if target.version is not None else None
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        if self.tracing:
            attr.inject_traceparent(headers)
        rewrite = _model_rewrite(name, target.logical_id) if name is not None else None
        usage = _Usage(self.metrics, target.logical_id, span)
        replica.begin(name)
        try:
            with _upstream_errors(replica):
                async with self.pool.session.post(
                    replica.url + request.path, data=self.upstream_body(parsed, target), headers=headers
                ) as upstream:
                    self.metrics.ttfb.labels(target.logical_id).observe(time.monotonic() - started)
                    if parsed.stream and upstream.content_type == "text/event-stream":
                        response = await _relay_stream(
                            request, upstream, rewrite, usage, _evidence(target, replica)
                        )
                    else:
                        payload = await upstream.read()
                        usage.scan(payload)
                        if rewrite is not None:
                            payload = rewrite.apply(payload)
                        response = web.Response(
                            body=payload, status=upstream.status, headers=_evidence(target, replica)
                        )
                        response.content_type = upstream.content_type
            if response.status == 200 and target.keys:
                self.index.record(target.keys, replica.url)
            return response
        finally:
            replica.end(name)

    async def status(self, request: web.Request) -> web.Response:
        """Admin view: what this kvgate serves and what each replica reports."""
        self.check_admin(request)
        versions = {
            s.logical_id: {
                "digest": s.digest,
                "name": s.name,
                "epoch": s.epoch,
                "base": s.base,
                "path": s.path,
            }
            for s in self.snapshot
        }
        replicas = [
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "base": r.listing.base_name,
             "adapters": r.listing.adapters}
            for r in self.pool.replicas
        ]  # fmt: skip
        doc = {
            "generation": self.snapshot.generation,
            "snapshot_flushed": self.snapshot.flushed,
            "snapshot_staleness_s": self.snapshot.staleness(),
            "versions": versions,
            "replicas": replicas,
            "prefix_index_entries": len(self.index),
        }
        return web.json_response(doc)

    async def list_models(self, request: web.Request) -> web.Response:
        base = self.options.base_model
        ids = [(base, None), *sorted((state.logical_id, base) for state in self.snapshot)]
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvgate", "parent": parent}
            for model, parent in ids
        ]
        return web.json_response({"object": "list", "data": data})


def _describe_target(span: Span, request: web.Request, target: Target, provider: str) -> None:
    if not span.is_recording():
        return
    span.set_attribute(
        attr.OPERATION, "chat" if request.path.endswith("chat/completions") else "text_completion"
    )
    span.set_attribute(attr.PROVIDER, provider)
    span.set_attribute(attr.REQUEST_MODEL, target.logical_id)
    span.set_attribute(attr.LOGICAL_ID, target.logical_id)
    if target.version is not None:
        span.set_attribute(attr.RESPONSE_MODEL, target.logical_id)
        span.set_attribute(attr.VERSION_NAME, target.version.name)
        span.set_attribute(attr.VERSION_DIGEST, target.version.digest)
        span.set_attribute(attr.EPOCH, target.version.epoch)
        span.set_attribute(attr.BASE, target.version.base)
    if target.keys:
        span.set_attribute(attr.BLOCK_KEY, target.keys[0].hex())


def _describe_choice(span: Span, choice: Choice, target: Target) -> None:
    if not span.is_recording():
        return
    span.set_attribute(attr.REPLICA, choice.replica.url)
    span.set_attribute(attr.ROUTING, choice.decision)
    span.set_attribute(attr.MATCHED_BLOCKS, choice.matched_blocks)
    span.set_attribute(attr.PREDICTED_HIT, choice.matched_blocks > 0)
    if target.version is not None:
        span.set_attribute(attr.REPLICA_LOADED, choice.replica.listing.adapters.get(target.version.name, ""))


class _Usage:
    """Reads ``usage`` numbers out of response bytes (no JSON parse) into metrics and the span."""

    __slots__ = ("label", "metrics", "span")

    def __init__(self, metrics: Metrics, label: str, span: Span) -> None:
        self.metrics, self.label, self.span = metrics, label, span

    def scan(self, data: bytes) -> None:
        if b'"usage"' not in data:
            return
        cached = _CACHED_TOKENS.search(data)
        prompt = _PROMPT_TOKENS.search(data)
        if prompt is not None:
            self.metrics.prompt_tokens.labels(self.label).inc(int(prompt.group(1)))
        if cached is not None:
            self.metrics.cached_tokens.labels(self.label).inc(int(cached.group(1)))
            self.span.set_attribute(attr.CACHED_TOKENS, int(cached.group(1)))


class _ModelRewrite:
    """Rewrites the ``model`` field from the versioned name back to the logical ID, as bytes.

    Only the exact JSON member ``"model":"<versioned name>"`` (with or without a space) is touched,
    so generated text is never altered; versioned names are unique, so no parse is needed.
    """

    __slots__ = ("pairs",)

    def __init__(self, versioned: str, logical: str) -> None:
        v, lg = json.dumps(versioned).encode(), json.dumps(logical).encode()
        self.pairs = ((b'"model":' + v, b'"model":' + lg), (b'"model": ' + v, b'"model": ' + lg))

    def apply(self, data: bytes) -> bytes:
        for old, new in self.pairs:
            if old in data:
                data = data.replace(old, new)
        return data


@functools.lru_cache(maxsize=4096)
def _model_rewrite(versioned: str, logical: str) -> _ModelRewrite:
    return _ModelRewrite(versioned, logical)


def _evidence(target: Target, replica: Replica) -> dict[str, str]:
    headers = {REPLICA_HEADER: replica.url}
    if target.version is not None:
        headers[VERSION_HEADER] = target.version.name
        headers[DIGEST_HEADER] = target.version.digest
        headers[EPOCH_HEADER] = str(target.version.epoch)
    if target.keys:
        headers[PREFIX_KEY_HEADER] = target.keys[0].hex()
    return headers


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    rewrite: _ModelRewrite | None,
    usage: _Usage,
    headers: dict[str, str],
) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    pending = b""  # an incomplete line: rewrites only ever see whole lines
    try:
        async for chunk in upstream.content.iter_any():
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n") + 1
            pending = data[cut:]
            if cut:
                await response.write(_transform(data[:cut], rewrite, usage))
        if pending:
            await response.write(_transform(pending, rewrite, usage))
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Bytes already went out: the status is sent, so the error travels as a final SSE event.
        error = BackendUnreachable(f"upstream stream broke: {exc!r}")
        await response.write(b"data: " + error.json_bytes() + b"\n\n")
    await response.write_eof()
    return response


def _transform(data: bytes, rewrite: _ModelRewrite | None, usage: _Usage) -> bytes:
    usage.scan(data)
    return rewrite.apply(data) if rewrite is not None else data


@contextlib.contextmanager
def _upstream_errors(replica: Replica) -> Iterator[None]:
    """The one place upstream client errors become kvgate errors."""
    try:
        yield
    except KvgateError:
        raise
    except TimeoutError as exc:
        raise BackendTimeout(f"replica {replica.url} timed out") from exc
    except aiohttp.ClientError as exc:
        raise BackendUnreachable(f"replica {replica.url} is unreachable: {exc!r}") from exc
