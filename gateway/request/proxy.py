"""The OpenAI-compatible request path, in stages: caller → parse → resolve (snapshot) → schedule → forward.

Going in, ``model`` is rewritten from the logical ID to the versioned name and the gateway sets the
cache namespace (the client's ``cache_salt`` is never forwarded). Coming out (``relay``), the versioned
name is rewritten back to the logical ID and headers say which effective model answered. Where a
request runs is the scheduler's decision; this module carries it out (a load through the loader, then
the forward). No Redis command runs here: the snapshot (and the API key copy) is local. Each request
leaves one span and its metrics. With API keys on, the caller stage runs first (``auth``): what a caller
may not use resolves as not found, the base model runs in the caller's tenant namespace, and the
caller's ``Authorization`` (kvgate's credential) never goes on to a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.trace import NoOpTracer, Span, SpanKind, StatusCode, Tracer

from gateway.core.body import Body, decode, splice
from gateway.core.errors import (
    BackendUnreachable,
    BodyTooLarge,
    ClientClosed,
    KvgateError,
    NoEligibleReplica,
    VersionUnloading,
)
from gateway.core.identity import is_logical_id
from gateway.core.model import Target
from gateway.core.prefix import block_keys
from gateway.core.scheduler import Decision, Scheduler
from gateway.core.wire import (
    AUTHORIZATION_HEADER,
    cache_salt,
    cold_salt,
    replica_id,
    tenant_salt,
)
from gateway.fleet.backends import BackendDialect
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.request import relay
from gateway.request.admin import Admin, AdminOptions
from gateway.request.auth import Auth, not_found
from gateway.table.callers import Caller, may_use, may_use_base
from gateway.table.snapshot import Snapshot
from gateway.telemetry import tracing as attr
from gateway.telemetry.metrics import UNKNOWN, Metrics

log = logging.getLogger(__name__)

INLINE_PARSE_BYTES = 64 * 1024
"""Bodies larger than this are decoded in a worker thread, one at a time: orjson holds the GIL while it
parses, so two at once could keep the event loop waiting for both; one at a time, for one at most."""
CHUNKED_SEND_BYTES = 1024 * 1024
"""Upstream bodies larger than this go out in 64 KiB writes, with the event loop free between them."""


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    base_model: str
    base_identity: str
    max_body_bytes: int
    namespaces: bool  # set the gateway's cache namespace on requests (version-scoped invalidation)
    expose_replica_urls: bool = False  # evidence names replicas by URL, not by replica_id


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    decoded: Body
    raw: bytes
    admin: AdminOptions

    @property
    def body(self) -> dict[str, Any]:
        return self.decoded.doc

    @property
    def model(self) -> str:
        return self.decoded.model

    @property
    def stream(self) -> bool:
        return self.decoded.stream


class Proxy:
    def __init__(
        self,
        snapshot: Snapshot,
        pool: ReplicaPool,
        loader: AdapterLoader,
        leases: Leases,
        scheduler: Scheduler,
        admin: Admin,
        dialect: BackendDialect,
        options: ProxyOptions,
        *,
        auth: Auth,
        activity: dict[str, float],
        metrics: Metrics,
        tracer: Tracer,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.loader = loader
        self.leases = leases
        self.scheduler = scheduler
        self.admin = admin
        self.dialect = dialect
        self.options = options
        self.activity = activity
        """Logical ID -> monotonic time of its last request (the canary audits active IDs)."""
        self.metrics = metrics
        self.tracer = tracer
        self.tracing = not isinstance(tracer, NoOpTracer)
        self.auth = auth
        self.replica_names = {
            r.url: r.url if options.expose_replica_urls else replica_id(r.url) for r in pool.replicas
        }
        """Replica URL -> what responses call it (evidence headers, upstream error messages)."""
        self.decoding = asyncio.Semaphore(1)  # large bodies, decoded off the event loop one at a time

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        label, outcome = UNKNOWN, "error"
        with self.tracer.start_as_current_span("kvgate.proxy", kind=SpanKind.SERVER) as span:
            try:
                caller = self.auth.caller(request)
                parsed = await self.parse(request)
                target = self.resolve(parsed, caller)
                label = self.metrics.for_request(target.logical_id)
                if target.version is not None:
                    self.activity[target.logical_id] = started
                _describe_target(span, request, target, self.dialect.name)
                response = await self.schedule_and_forward(request, parsed, target, span, started)
                outcome = str(response.status)
                return response
            except KvgateError as exc:
                outcome = exc.type
                span.set_status(StatusCode.ERROR, exc.message)
                raise
            except asyncio.CancelledError:  # the client left (aiohttp cancels its handler), or shutdown
                outcome = ClientClosed.type
                raise
            finally:
                self.metrics.requests.labels(label, outcome).inc()
                self.metrics.latency.observe(time.monotonic() - started)

    async def schedule_and_forward(
        self, request: web.Request, parsed: ParsedRequest, target: Target, span: Span, started: float
    ) -> web.StreamResponse:
        """Stages 3 and 4. A replica that fails before the first byte reaches the client is marked
        unhealthy (until its next good poll) and the request goes to the next eligible one; pinned
        requests are never moved. After the first byte, errors travel as a final SSE event instead.
        A client that leaves (``ClientClosed``) or a replica without a free connection (``ReplicaBusy``)
        is no fault of the replica: neither marks it nor retries."""
        pin = parsed.admin.pin
        for attempt in range(len(self.pool.replicas)):
            decision = await self.schedule(target, pin)
            _describe_decision(span, decision, target)
            self.metrics.routing.labels(decision.reason).inc()
            self.metrics.prefix_matched_blocks.observe(decision.matched_blocks)
            try:
                return await self.forward(request, parsed, target, decision.replica, span, started)
            except VersionUnloading:  # another kvgate is unloading it there: look again (load or elsewhere)
                await self.pool.refresh(decision.replica)
                if attempt + 1 == len(self.pool.replicas):
                    raise
                continue
            except BackendUnreachable:
                decision.replica.healthy = False
                if pin is not None or attempt + 1 == len(self.pool.replicas):
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
        if len(raw) <= INLINE_PARSE_BYTES:
            decoded = decode(raw)
        else:
            async with self.decoding:
                decoded = await asyncio.to_thread(decode, raw)
        admin = self.admin.options(request)
        return ParsedRequest(decoded, raw, admin)

    # --- stage 2: resolve ------------------------------------------------------------------------

    def resolve(self, parsed: ParsedRequest, caller: Caller | None) -> Target:
        """The effective model; what ``caller`` may not use is not found, exactly like an unknown ID. A
        base model is any base a healthy replica serves (by its listing), or the configured one."""
        served_bases = self.pool.base_identities()
        if parsed.model == self.options.base_model or parsed.model in served_bases:
            if not may_use_base(caller):
                raise not_found(parsed.model)
            if parsed.model == self.options.base_model:
                base = self.options.base_identity
            else:
                base = served_bases[parsed.model]
            salt = tenant_salt(base, caller.tenant) if caller is not None else None
            return Target(parsed.model, base, None, salt, [])
        version = self.snapshot.get(parsed.model) if is_logical_id(parsed.model) else None
        if version is None or not may_use(caller, parsed.model):  # a name that cannot be a logical ID,
            raise not_found(parsed.model)  # or one the caller may not use, is never served
        expected = self.pool.expected_print(version)  # a replica of another base never serves it
        if parsed.admin.cold:
            return Target(parsed.model, version.base, version, cold_salt(), [], expected)
        salt = cache_salt(self.snapshot.generation, version)
        keys = block_keys(salt, parsed.decoded.prompt)
        return Target(parsed.model, version.base, version, salt, keys, expected)

    # --- stage 3: schedule -----------------------------------------------------------------------

    async def schedule(self, target: Target, pin: Replica | None) -> Decision[Replica]:
        """The scheduler's decision, carried out: a "load on R" loads first. A replica that turns out
        to be down during the load is marked unhealthy and the scheduler decides again (unless pinned)."""
        pin_url = pin.url if pin is not None else None
        for _ in range(len(self.pool.replicas)):
            decision = self.scheduler.decide(self.pool.replicas, target, pin=pin_url)
            if decision.action == "serve" or target.version is None:
                return decision
            try:
                await self.loader.ensure_loaded(target.version, decision.replica)
                return decision
            except NoEligibleReplica:
                if pin is not None or decision.replica.healthy:
                    raise
                log.warning("%s is down; loading %s elsewhere", decision.replica.url, target.version.name)
        raise NoEligibleReplica(f"no replica could serve {target.logical_id!r}", param="model")

    # --- stage 4: forward ------------------------------------------------------------------------

    def upstream_body(self, parsed: ParsedRequest, target: Target) -> bytes | io.BytesIO:
        """The client's body as it came, or, when kvgate must change it, the body serialized once at parse
        time without ``model`` and the client's namespace fields (a client never chooses a cache
        namespace) with the gateway's own members spliced in: nothing is serialized again here.
        A large body is wrapped in a BytesIO (no copy), which aiohttp sends in chunks."""
        if target.version is None and target.salt is None and not parsed.decoded.namespaced:
            body = parsed.raw
        else:
            owned = {"model": target.version.name if target.version is not None else parsed.model}
            if target.version is not None:
                namespaced = self.options.namespaces  # the version's namespace (version-scoped invalidation)
            else:
                namespaced = self.dialect.cache_namespaces  # the tenant's base-model namespace
            if target.salt is not None and namespaced:
                self.dialect.set_cache_namespace(owned, target.salt)
            body = splice(parsed.decoded.rest, owned)
        return io.BytesIO(body) if len(body) > CHUNKED_SEND_BYTES else body

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
        if AUTHORIZATION_HEADER in request.headers and not self.auth.on:  # with keys on: kvgate's, not theirs
            headers[AUTHORIZATION_HEADER] = request.headers[AUTHORIZATION_HEADER]
        if self.tracing:
            attr.inject_traceparent(headers)
        rewrite = relay.model_rewrite(name, target.logical_id) if name is not None else None
        usage = relay.Usage(self.metrics, self.metrics.for_id(target.logical_id), span)
        evidence = relay.evidence(target, self.replica_names[replica.url])
        async with self._in_use(replica, name):
            with relay.upstream_errors(self.replica_names[replica.url]):
                # a connection slot is held to the last byte relayed (ReplicaBusy if none frees in time)
                async with (
                    replica.connection(),
                    self.pool.session.post(
                        replica.url + request.path, data=self.upstream_body(parsed, target), headers=headers
                    ) as upstream,
                ):
                    self.metrics.ttfb.observe(time.monotonic() - started)
                    if parsed.stream and upstream.content_type == "text/event-stream":
                        response = await relay.relay_stream(request, upstream, rewrite, usage, evidence)
                    else:
                        response = await relay.relay_body(upstream, rewrite, usage, evidence)
            if response.status == 200:
                self.scheduler.served(target, replica)
            return response

    @contextlib.asynccontextmanager
    async def _in_use(self, replica: Replica, name: str | None) -> AsyncIterator[None]:
        """Count the request on the replica (and lease its version there, fleet-wide) while it runs."""
        if name is not None and not await self.leases.acquire(replica.url, name):
            raise VersionUnloading(f"{name} is being unloaded from {replica.url}")
        replica.begin(name)
        try:
            yield
        finally:
            replica.end(name)
            if name is not None:
                self.leases.release(replica.url, name)


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


def _describe_decision(span: Span, decision: Decision[Replica], target: Target) -> None:
    if not span.is_recording():
        return
    span.set_attribute(attr.REPLICA, decision.replica.url)
    span.set_attribute(attr.ROUTING, decision.reason)
    span.set_attribute(attr.MATCHED_BLOCKS, decision.matched_blocks)
    span.set_attribute(attr.PREDICTED_HIT, decision.matched_blocks > 0)
    if target.version is not None:
        loaded = decision.replica.listing.adapters.get(target.version.name, "")
        span.set_attribute(attr.REPLICA_LOADED, loaded)
