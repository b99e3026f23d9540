"""Stage 1 of the request path (parse), and what goes upstream: the client's request read once, as its
route's kind says, and the body the chosen replica gets with the gateway's own members in it.

A JSON body is decoded once (``core.body``; a large one in the body lane, ``body_lane``, with its
prompt's tokens when kvgate tokenizes, handed back bounded to what the request path reads); a multipart
form (audio) is read into memory once, so a retry on another replica sends it again; a follow-up by
response id and ``/v1/models/{model}`` carry what they name in the path.

A follow-up of a stored response (``GET /v1/responses/{id}``, its cancel, a new response with
``previous_response_id``) is pinned to the replica its id names (vLLM keeps stored responses in the
memory of the replica that made them); an id kvgate did not mint, whose replica left the pool, or that
another tenant owns is the same 404. Going up, ``model`` is the
versioned name, the gateway's cache namespace is set where the route takes one (a client's is never
forwarded), and ``/v1/responses`` gets a response id that names the replica (``wire.response_id``).
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web

from gateway.core.body import Body, decode, forwarded, stream_flag
from gateway.core.errors import BadRequest, BodyTooLarge, RequestTimeout, ResponseNotFound
from gateway.core.model import Target
from gateway.core.prefix import BLOCK_CHARS, PREFIX_CHARS, content_keys, prompt_text
from gateway.core.wire import CLIENT_NAMESPACE_FIELDS, replica_id, response_id, response_owner, response_parts
from gateway.fleet.backends import BackendDialect
from gateway.fleet.replicas import Replica
from gateway.kv.prompt_tokens import PromptTokens, Tokens
from gateway.request.admin import Admin, AdminOptions
from gateway.request.body_lane import BodyLane, Handover, HandsOver, Held, HeldUpstream
from gateway.request.routes import Route
from gateway.table.callers import Caller
from gateway.telemetry.metrics import Metrics

INLINE_PARSE_BYTES = 32 * 1024
"""Bodies larger than this are read (if still arriving) and decoded in the body lane (``body_lane``):
parsing, rendering and tokenizing hold the GIL, and a prompt of this many characters is where
tokenizing it starts to cost milliseconds (``prompt_tokens.MAX_CHARS``); below it, the round trip costs
more than the work."""
CHUNKED_SEND_BYTES = 1024 * 1024
"""Upstream bodies larger than this go out in 64 KiB writes, with the event loop free between them."""
_OWNED_BY_MINTING = frozenset(("request_id",))


@dataclass(frozen=True, slots=True)
class FormField:
    name: str
    value: str | bytes
    filename: str | None = None
    content_type: str | None = None


@dataclass(slots=True)
class ParsedRequest:
    route: Route
    caller: Caller | None
    model: str  # "" when the route allows none: the base model
    stream: bool
    admin: AdminOptions
    decoded: Body | None = None  # a JSON body
    raw: bytes = b""
    form: tuple[FormField, ...] = ()  # a multipart body
    path_id: str = ""  # the response id or model named in the path
    tokens: Tokens | None = None  # a large body's prompt tokens, computed where it was parsed
    held: Held | None = None  # a body the body lane read and holds (then ``raw`` is empty)

    @property
    def body(self) -> dict[str, Any]:
        return self.decoded.doc if self.decoded is not None else {}

    def prompt_keys(self, limit: int = PREFIX_CHARS) -> Sequence[bytes]:
        """The ``content_keys`` of the prompt's first ``limit`` characters as prefix keys see it
        (``prompt_text``, rendered only as far as ``limit``)."""
        if self.decoded is None:
            return []
        keys = self.decoded.head_keys  # a bounded body's, computed where it was parsed
        if keys is not None and limit <= PREFIX_CHARS:
            return keys[: limit // BLOCK_CHARS]
        return content_keys(prompt_text(self.decoded.doc, limit))

    @property
    def stored_response(self) -> str | None:
        """The stored response this request follows up, if any."""
        if self.route.kind == "response":
            return self.path_id
        previous = self.body.get("previous_response_id")
        return previous if isinstance(previous, str) and self.route.mints_response_id else None

    @property
    def tenant(self) -> str | None:
        return self.caller.tenant if self.caller is not None else None


class Intake:
    def __init__(
        self,
        admin: Admin,
        replicas: list[Replica],
        max_body_bytes: int,
        tokens: PromptTokens | None = None,
        metrics: Metrics | None = None,
        send_timeout: float = 600.0,
    ) -> None:
        """``tokens``: the tokenizer the tokenize stage uses, when it tokenizes (a large body's prompt is
        tokenized where it is parsed); ``send_timeout``: the body lane's bound on writing a body upstream."""
        self.admin = admin
        self.replicas = {replica_id(r.url): r for r in replicas}
        self.max_body_bytes = max_body_bytes
        self.lane = BodyLane(tokens, metrics, send_timeout)

    def close(self) -> None:
        self.lane.close()

    async def parse(self, request: web.Request, route: Route, caller: Caller | None) -> ParsedRequest:
        parsed = await self._read(request, route, caller)
        stored = parsed.stored_response
        return parsed if stored is None else self._follow(parsed, stored)

    async def _read(self, request: web.Request, route: Route, caller: Caller | None) -> ParsedRequest:
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit")
        admin = self.admin.options(request)
        try:
            if route.kind == "form":
                return await self._form(request, route, caller, admin)
            if route.kind == "response":
                stream = stream_flag(request.query.get("stream"))
                path_id = request.match_info["response_id"]
                return ParsedRequest(route, caller, "", stream, admin, path_id=path_id)
            if route.kind == "model-card":
                model = request.match_info["model"]
                return ParsedRequest(route, caller, model, False, admin, path_id=model)
            if not route.has_body:
                return ParsedRequest(route, caller, "", False, admin)
            owned = _OWNED_BY_MINTING if route.mints_response_id else frozenset()
            handover = _hand_over(request)
            if handover is not None and handover.fd is not None:  # the body lane reads it
                decoded, tokens, held = await self._take(handover, route, owned)
                parsed = ParsedRequest(route, caller, decoded.model, decoded.stream, admin, decoded)
                parsed.tokens, parsed.held = tokens, held
                return parsed
            raw = handover.arrived if handover is not None else await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit") from exc
        tokens = None
        if len(raw) <= INLINE_PARSE_BYTES:
            decoded = decode(raw, model_optional=route.model_optional, owned=owned)
        else:  # in the body lane: no other request waits for it
            decoded, tokens = await self.lane.parse(
                raw, route.path, model_optional=route.model_optional, owned=owned
            )
        return ParsedRequest(route, caller, decoded.model, decoded.stream, admin, decoded, raw, tokens=tokens)

    async def _take(
        self, handover: Handover, route: Route, owned: frozenset[str]
    ) -> tuple[Body, Tokens | None, Held]:
        assert handover.fd is not None
        try:
            taken = await self.lane.take(
                handover, route.path, model_optional=route.model_optional, owned=owned
            )
        except BadRequest as exc:  # a body read whole that is not a good request: the connection closes
            if isinstance(exc, RequestTimeout):
                handover.abandon()  # not read whole: the rest is dropped before the connection closes
            raise
        except BaseException:
            handover.abandon()
            raise
        finally:
            os.close(handover.fd)
        handover.taken()  # read whole: a client that leaves from now on cancels its request
        return taken

    async def _form(
        self, request: web.Request, route: Route, caller: Caller | None, admin: AdminOptions
    ) -> ParsedRequest:
        if request.content_type not in ("multipart/form-data", "application/x-www-form-urlencoded"):
            raise BadRequest(f"{route.path} takes a multipart/form-data body")
        text_rule = (
            f"{route.path}: every field name and text field of the form (model among them) must be text "
            "in its part's charset (UTF-8 unless the part names another that exists)"
        )
        try:
            posted = await request.post()
        except (UnicodeDecodeError, LookupError) as exc:  # a text field not in its part's charset
            raise BadRequest(text_rule) from exc
        except ValueError as exc:  # aiohttp's words for a malformed form: no boundary, no name, cut short
            malformed = f"{route.path}: the body is not a well-formed {request.content_type} form"
            raise BadRequest(malformed) from exc
        fields: list[FormField] = []
        for name, value in posted.items():
            try:
                name.encode()  # a name that is not UTF-8 arrives with surrogates, and could not go upstream
            except UnicodeEncodeError as exc:
                raise BadRequest(text_rule) from exc
            if isinstance(value, web.FileField):
                data = await asyncio.to_thread(value.file.read)
                fields.append(FormField(name, data, value.filename, value.content_type))
            else:
                fields.append(FormField(name, value if isinstance(value, str) else bytes(value)))
        model = next((f.value for f in fields if f.name == "model"), "")
        if not isinstance(model, str):  # a part with a binary content type
            raise BadRequest("the model field must be a text part (UTF-8), not binary data", param="model")
        if not model and not route.model_optional:
            raise BadRequest("you must provide a model parameter", param="model")
        stream = stream_flag(next((f.value for f in fields if f.name == "stream"), None))
        return ParsedRequest(route, caller, model, stream, admin, form=tuple(fields))

    def _follow(self, parsed: ParsedRequest, stored: str) -> ParsedRequest:
        """``parsed`` pinned to the replica that stores the response it follows up."""
        parts = response_parts(stored)
        replica = self.replicas.get(parts[0]) if parts is not None else None
        if parts is None or replica is None or not _owns(parsed.caller, parts[1]):
            raise ResponseNotFound(
                f"Response with id '{stored}' not found (ids kvgate did not issue cannot be followed up).",
                param="previous_response_id" if parsed.route.kind != "response" else None,
                code="response_not_found",
            )
        if parsed.admin.pin is not None and parsed.admin.pin is not replica:
            raise BadRequest(f"response {stored!r} is stored on another replica than the pinned one")
        return replace(parsed, admin=replace(parsed.admin, pin=replica))


def _hand_over(request: web.Request) -> Handover | None:
    """A large body taken from the server as it arrives (``body_lane``): not one whose bytes on the
    wire are not its JSON (a ``Content-Encoding``), nor on a connection that cannot hand it over."""
    length = request.content_length
    if (
        length is None
        or length <= INLINE_PARSE_BYTES
        or request.headers.get("Content-Encoding", "identity") != "identity"
    ):
        return None
    protocol = request.protocol
    return protocol.hand_over(request) if isinstance(protocol, HandsOver) else None


def _owns(caller: Caller | None, owner: str) -> bool:
    """Whether ``caller`` may follow up a response with this owner (None: keys off or the operator)."""
    return caller is None or response_owner(caller.tenant) == owner


Upstream = bytes | io.BytesIO | aiohttp.FormData | HeldUpstream | None


def upstream_body(
    parsed: ParsedRequest, target: Target, replica_url: str, dialect: BackendDialect, *, namespaces: bool
) -> Upstream:
    """The body the replica gets. JSON: the client's bytes as they came or, when kvgate must change
    them, those bytes with the gateway's own members spliced in (``body.forwarded``). ``namespaces``:
    version namespaces are on."""
    if parsed.route.kind == "form":
        return _form_body(parsed, target)
    if parsed.decoded is None:
        return None
    owned: dict[str, str] = {}
    if target.version is not None or parsed.model:
        owned["model"] = target.version.name if target.version is not None else parsed.model
    namespaced = namespaces if target.version is not None else dialect.cache_namespaces
    if parsed.route.namespaced and target.salt is not None and namespaced:
        dialect.set_cache_namespace(owned, target.salt)
    if parsed.route.mints_response_id:
        owned["request_id"] = response_id(replica_url, parsed.tenant)
    changed = target.version is not None or bool(set(owned) - {"model"}) or parsed.decoded.namespaced
    if parsed.held is not None:  # the body lane sends it
        return HeldUpstream(parsed.held, owned if changed else None)
    return chunked(forwarded(parsed.decoded, owned) if changed else parsed.raw)


def chunked(body: bytes) -> bytes | io.BytesIO:
    """A very large body as aiohttp's client sends it in pieces (``CHUNKED_SEND_BYTES``)."""
    return io.BytesIO(body) if len(body) > CHUNKED_SEND_BYTES else body


def _form_body(parsed: ParsedRequest, target: Target) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for field in parsed.form:
        if field.name in CLIENT_NAMESPACE_FIELDS:
            continue  # a client never chooses a cache namespace
        value = field.value
        if field.name == "model" and target.version is not None:
            value = target.version.name
        form.add_field(field.name, value, filename=field.filename, content_type=field.content_type)
    return form
