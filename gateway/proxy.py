"""The OpenAI-compatible request path, in stages: parse → resolve (snapshot) → schedule → forward.

Going in, ``model`` is rewritten from the logical ID to the versioned name and the gateway sets the
cache namespace (the client's ``cache_salt`` is never forwarded). Coming out, the versioned name is
rewritten back to the logical ID in the body and in every SSE line, and headers say which effective
model answered: ``x-kvgate-version``, ``x-kvgate-digest``, ``x-kvgate-epoch``, ``x-kvgate-replica``.
No Redis command runs here: the snapshot is local.
"""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from blake3 import blake3

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
from gateway.replicas import Replica, ReplicaPool
from gateway.routing import eligible, pick, same_base
from gateway.snapshot import Snapshot

SALT_PREFIX = "kvg-"
PIN_HEADER = "x-kvgate-pin"
ADMIN_TOKEN_HEADER = "x-kvgate-admin-token"
_HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    pin: Replica | None  # audits pin a request to one replica (admin token required)


@dataclass(frozen=True, slots=True)
class Target:
    """The effective model a request meets: a published version, or the base model (version None)."""

    logical_id: str
    version: VersionState | None
    salt: str | None


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
        *,
        base_model: str,
        base_identity: str,
        base_with_root: bool,
        max_body_bytes: int,
        admin_token: str | None,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.loader = loader
        self.dialect = dialect
        self.base_model = base_model
        self.base_identity = base_identity
        self.base_with_root = base_with_root
        self.max_body_bytes = max_body_bytes
        self.admin_token = admin_token

    # --- stage 1: parse --------------------------------------------------------------------------

    async def parse(self, request: web.Request) -> ParsedRequest:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise BodyTooLarge(f"request body is over the {self.max_body_bytes}-byte limit")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLarge(f"request body is over the {self.max_body_bytes}-byte limit") from exc
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("you must provide a model parameter", param="model")
        return ParsedRequest(body, raw, model, stream=body.get("stream") is True, pin=self._pin(request))

    def _pin(self, request: web.Request) -> Replica | None:
        url = request.headers.get(PIN_HEADER)
        if url is None:
            return None
        token = request.headers.get(ADMIN_TOKEN_HEADER, "")
        if self.admin_token is None or not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            raise Unauthorized(f"{PIN_HEADER} needs a valid {ADMIN_TOKEN_HEADER}")
        for replica in self.pool.replicas:
            if replica.url == url.rstrip("/"):
                return replica
        raise BadRequest(f"{PIN_HEADER}: {url!r} is not one of this pool's replicas")

    # --- stage 2: resolve ------------------------------------------------------------------------

    def resolve(self, model: str) -> Target:
        if model == self.base_model:
            return Target(model, None, None)
        version = self.snapshot.get(model)
        if version is None:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return Target(model, version, cache_salt(self.snapshot.generation, version))

    # --- stage 3: schedule -----------------------------------------------------------------------

    async def schedule(self, target: Target, pin: Replica | None) -> Replica:
        if target.version is None:
            candidates = same_base(self.pool.replicas, self.base_identity, with_root=self.base_with_root)
        else:
            candidates = eligible(self.pool.replicas, target.version, with_root=self.base_with_root)
        if pin is not None:
            candidates = [replica for replica in candidates if replica is pin]
        if candidates:
            return pick(candidates)
        if target.version is None:
            raise NoEligibleReplica(f"no healthy replica serves base model {self.base_model!r}")
        return await self.loader.ensure_loaded(target.version, on=pin)

    # --- stage 4: forward ------------------------------------------------------------------------

    def upstream_body(self, parsed: ParsedRequest, target: Target) -> bytes:
        if target.version is None and "cache_salt" not in parsed.body:
            return parsed.raw
        body = dict(parsed.body)
        body.pop("cache_salt", None)  # a client never chooses a cache namespace
        if target.version is not None:
            body["model"] = target.version.name
            if target.salt is not None:
                self.dialect.set_cache_namespace(body, target.salt)
        return json.dumps(body, separators=(",", ":")).encode()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        parsed = await self.parse(request)
        target = self.resolve(parsed.model)
        replica = await self.schedule(target, parsed.pin)
        return await self.forward(request, parsed, target, replica)

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, target: Target, replica: Replica
    ) -> web.StreamResponse:
        name = target.version.name if target.version is not None else None
        headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        rewrite = _ModelRewrite(name, target.logical_id) if name is not None else None
        replica.begin(name)
        try:
            with _upstream_errors(replica):
                async with self.pool.session.post(
                    replica.url + request.path, data=self.upstream_body(parsed, target), headers=headers
                ) as upstream:
                    is_sse = upstream.content_type == "text/event-stream"
                    if parsed.stream and is_sse:
                        return await _relay_stream(request, upstream, rewrite, _evidence(target, replica))
                    payload = await upstream.read()
            if rewrite is not None:
                payload = rewrite.apply(payload)
            response = web.Response(body=payload, status=upstream.status, headers=_evidence(target, replica))
            response.content_type = upstream.content_type
            return response
        finally:
            replica.end(name)

    async def list_models(self, request: web.Request) -> web.Response:
        data = [
            {"id": self.base_model, "object": "model", "created": 0, "owned_by": "kvgate", "parent": None}
        ]
        data += [
            {
                "id": state.logical_id,
                "object": "model",
                "created": 0,
                "owned_by": "kvgate",
                "parent": self.base_model,
            }
            for state in sorted(self.snapshot, key=lambda s: s.logical_id)
        ]
        return web.json_response({"object": "list", "data": data})


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


def _evidence(target: Target, replica: Replica) -> dict[str, str]:
    headers = {"x-kvgate-replica": replica.url}
    if target.version is not None:
        headers["x-kvgate-version"] = target.version.name
        headers["x-kvgate-digest"] = target.version.digest
        headers["x-kvgate-epoch"] = str(target.version.epoch)
    return headers


async def _relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    rewrite: _ModelRewrite | None,
    headers: dict[str, str],
) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    try:
        async for line in upstream.content:
            await response.write(rewrite.apply(line) if rewrite is not None else line)
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Bytes already went out: the status is sent, so the error travels as a final SSE event.
        error = BackendUnreachable(f"upstream stream broke: {exc!r}")
        await response.write(b"data: " + error.json_bytes() + b"\n\n")
    await response.write_eof()
    return response


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
