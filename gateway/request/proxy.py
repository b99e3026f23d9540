"""The OpenAI-compatible request path, in stages: caller → parse → resolve (snapshot) → schedule → forward.

Every vLLM model route (``routes.ROUTES``) takes this one path; the route's kind says how the body
carries the model (``intake``). Going in, ``model`` is rewritten from the logical ID to the versioned
name and the gateway sets the cache namespace where the route takes one (the client's ``cache_salt`` is
never forwarded). Coming out (``relay``), the versioned
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
from dataclasses import dataclass

from aiohttp import web
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind, StatusCode, Tracer

from gateway.core import wire
from gateway.core.errors import (
    BackendUnreachable,
    ClientClosed,
    KvgateError,
    NoEligibleReplica,
    ReplicaGoingDown,
    UpstreamError,
    VersionForgotten,
)
from gateway.core.identity import is_logical_id
from gateway.core.model import Target
from gateway.core.prefix import BLOCK_CHARS, PREFIX_CHARS, block_keys
from gateway.core.scheduler import Decision, Scheduler
from gateway.core.split import choose
from gateway.core.wire import AUTHORIZATION_HEADER, cache_salt, cold_salt, replica_id, tenant_salt
from gateway.fleet.backends import BackendDialect
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.fleet.reservation import Reservation
from gateway.kv.prompt_tokens import CHAT_COMPLETIONS, COMPLETIONS, PromptTokens, Unrendered
from gateway.request import relay, spans
from gateway.request.admin import Admin
from gateway.request.auth import Auth, not_found
from gateway.request.intake import Intake, ParsedRequest, upstream_body
from gateway.request.placement import Placement
from gateway.request.routes import Route
from gateway.request.upstream import Upstream
from gateway.table.callers import Caller, may_use, may_use_base
from gateway.table.snapshot import Snapshot
from gateway.telemetry import tracing as attr
from gateway.telemetry.metrics import UNKNOWN, Metrics
from gateway.telemetry.rollout_stats import RolloutStats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProxyOptions:
    base_model: str
    base_identity: str
    max_body_bytes: int
    namespaces: bool  # set the gateway's cache namespace on requests (version-scoped invalidation)
    expose_replica_urls: bool = False  # evidence names replicas by URL, not by replica_id
    tokens: PromptTokens | None = None  # the base model's tokenizer: precise prefix keys (KV events)
    connect_timeout: float = 5.0  # the forward's client (``upstream``): TCP connect
    read_timeout: float = 600.0  # and between received bytes


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
        rollouts: RolloutStats | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.rollouts = rollouts if rollouts is not None else RolloutStats()
        """Per-version figures of the running rollouts (the gate reads them)."""
        self.pool = pool
        self.scheduler = scheduler
        self.placement = Placement(pool, scheduler, loader, leases)  # stage 3 carries the loader and leases
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
        self.intake = Intake(admin, pool.replicas, options.max_body_bytes)
        self.upstream = Upstream(options.connect_timeout, options.read_timeout)  # the forward's client
        self.choosing = len(pool.replicas) > 1
        """More than one replica could serve a request: only then do prefix keys and tokens decide
        anything. With one, a request is keyed by its first block only (the ``x-kvgate-prefix-key``
        evidence the audit records) and never tokenized."""
        self.prefix_chars = PREFIX_CHARS if self.choosing else BLOCK_CHARS

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        started = time.monotonic()
        label, outcome, target, fault = UNKNOWN, "error", None, False
        spanning = self._span() if self.tracing else contextlib.nullcontext(INVALID_SPAN)
        with spanning as span:
            try:
                caller = self.auth.caller(request)
                parsed = await self.intake.parse(request, route, caller)
                target = self.resolve(parsed, caller)
                label = self.metrics.for_request(target.logical_id)
                if target.version is not None:
                    self.activity[target.logical_id] = started
                spans.describe_target(span, route, target, self.dialect.name)
                response = await self.schedule_and_forward(request, parsed, target, span, started)
                outcome, fault = str(response.status), response.status >= 500
                return response
            except KvgateError as exc:
                outcome, fault = exc.type, isinstance(exc, _FAULTS)
                exc.message = relay.public_message(exc.message, self.replica_names)  # no URL, no version
                span.set_status(StatusCode.ERROR, exc.message)
                raise
            except asyncio.CancelledError:  # the client left (aiohttp cancels its handler), or shutdown
                outcome = ClientClosed.type
                raise
            finally:
                self.metrics.child(self.metrics.requests, label, outcome).inc()
                self.metrics.latency.observe(time.monotonic() - started)
                if target is not None and target.role:  # a rollout runs: its per-version figures
                    self.rollouts.finished(target, error=fault)
                    self.metrics.version_requests.labels(label, target.role, "error" if fault else "ok").inc()

    def _span(self) -> contextlib.AbstractContextManager[Span]:
        return self.tracer.start_as_current_span("kvgate.proxy", kind=SpanKind.SERVER)

    async def schedule_and_forward(
        self, request: web.Request, parsed: ParsedRequest, target: Target, span: Span, started: float
    ) -> web.StreamResponse:
        """Stages 3 and 4, under the request's ``Reservation`` from the decision to the last byte. A
        replica that fails before the first byte reaches the client is marked unhealthy (until its next
        good poll) and the request goes to the next eligible one; pinned requests are never moved. A
        replica that answers it does not have the version (``VersionForgotten``) is looked at again and
        the request retried once (the version is loaded there again). After the first byte, errors
        travel as a final SSE event instead. A client that leaves (``ClientClosed``) or a replica
        without a free connection (``ReplicaBusy``) is no fault of the replica: neither marks it nor
        retries."""
        pin = parsed.admin.pin
        attempts, forgotten = len(self.pool.replicas), False
        while True:
            decision, reservation = await self.schedule(target, pin)
            spans.describe_decision(span, decision, target)
            self.metrics.child(self.metrics.routing, decision.reason).inc()
            matched = self.metrics.child(self.metrics.prefix_matched_blocks, decision.prefix_source)
            matched.observe(decision.matched_blocks)
            try:
                return await self.forward(request, parsed, target, reservation, decision, span, started)
            except VersionForgotten:
                await self.pool.refresh(decision.replica)
                if forgotten:
                    raise
                forgotten = True
                self.metrics.child(self.metrics.routing, "reload").inc()
            except BackendUnreachable:
                decision.replica.healthy = False
                attempts -= 1
                if pin is not None or attempts == 0:
                    raise
                self.metrics.child(self.metrics.routing, "retry").inc()
            finally:
                reservation.release()

    # --- stage 1: parse (``intake``: the body as the route's kind says; follow-ups pinned) ---------

    # --- stage 2: resolve ------------------------------------------------------------------------

    def resolve(self, parsed: ParsedRequest, caller: Caller | None) -> Target:
        """The effective model; what ``caller`` may not use is not found, exactly like an unknown ID.
        A base model is any base a healthy replica serves (by its listing), or the configured one; no
        model (where the route allows none) is the configured base; a follow-up of a stored response
        goes to its replica's base (``intake`` pinned it and checked the caller owns it)."""
        if parsed.route.kind == "response":
            pin = parsed.admin.pin
            base = pin.base if pin is not None and pin.base else self.options.base_identity
            return Target(UNKNOWN, base, None, None, [])
        model = parsed.model or self.options.base_model
        served_bases = self.pool.base_identities()
        if model == self.options.base_model or model in served_bases:
            if not may_use_base(caller):
                raise not_found(model)
            base = self.options.base_identity if model == self.options.base_model else served_bases[model]
            salt = tenant_salt(base, caller.tenant) if caller is not None else None
            return Target(model, base, None, salt, [], tokens=self.tokens(parsed))
        state = self.snapshot.get(parsed.model) if is_logical_id(parsed.model) else None
        if state is None or not may_use(caller, parsed.model):  # a name that cannot be a logical ID,
            raise not_found(parsed.model)  # or one the caller may not use, is never served
        # stage 2b, the split: while a rollout runs, the current version or the candidate (core/split.py)
        key_id = caller.key_id if caller is not None else None
        split = choose(state, parsed.body, key_id, parsed.prompt(BLOCK_CHARS))
        version, role, rollout = split.version, split.role if state.candidate else "", split.rollout
        expected = self.pool.expected_print(version)  # a replica of another base never serves it
        if parsed.admin.cold:
            return Target(parsed.model, version.base, version, cold_salt(), [], expected, (), role, rollout)
        salt = cache_salt(self.snapshot.generation, version)
        keys = block_keys(salt, parsed.prompt(self.prefix_chars))
        tokens = self.tokens(parsed)
        return Target(parsed.model, version.base, version, salt, keys, expected, tokens, role, rollout)

    def tokens(self, parsed: ParsedRequest) -> tuple[int, ...]:
        """The prompt's tokens as the replica will see them, when kvgate has the tokenizer and follows
        KV events (``request.tokens``); () otherwise, or when the request is not one it can reproduce exactly
        (``Unrendered``, counted by its reason)."""
        tokenizer = self.options.tokens
        if tokenizer is None or self.scheduler.precise is None or not self.choosing:
            return ()
        if parsed.route.path == COMPLETIONS:
            tokens = tokenizer.completion(parsed.body)
        elif parsed.route.path == CHAT_COMPLETIONS:
            tokens = tokenizer.chat(parsed.body)
        else:
            return ()
        if isinstance(tokens, Unrendered):  # counted: this request is routed on the predicted index
            self.metrics.child(self.metrics.prompt_unrendered, tokens.reason).inc()
            return ()
        return tokens

    # --- stage 3: schedule -----------------------------------------------------------------------

    async def schedule(self, target: Target, pin: Replica | None) -> tuple[Decision[Replica], Reservation]:
        """The scheduler's decision carried out, under the request's reservation (``placement``)."""
        return await self.placement.place(target, pin)

    # --- stage 4: forward ------------------------------------------------------------------------

    async def forward(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        target: Target,
        reservation: Reservation,
        decision: Decision[Replica],
        span: Span,
        started: float,
    ) -> web.StreamResponse:
        replica = reservation.replica
        name = target.version.name if target.version is not None else None
        route = parsed.route
        body = upstream_body(parsed, target, replica.url, self.dialect, namespaces=self.options.namespaces)
        headers = {"Content-Type": "application/json"} if isinstance(body, bytes | io.BytesIO) else {}
        if AUTHORIZATION_HEADER in request.headers and not self.auth.on:  # with keys on: kvgate's, not theirs
            headers[AUTHORIZATION_HEADER] = request.headers[AUTHORIZATION_HEADER]
        if self.tracing:
            attr.inject_traceparent(headers)
        rewrite = _rewrite(route, name, target.logical_id)
        usage = relay.Usage(self.metrics, self.metrics.for_id(target.logical_id), span)
        there = self.replica_names[replica.url]
        evidence = wire.evidence(target, there, decision.prefix_source, decision.matched_blocks)
        path = "/v1/models" if route.kind == "model-card" else request.path_qs  # vLLM has no models/{id}
        with relay.upstream_errors(there):
            # a connection slot is held to the last byte relayed (ReplicaBusy if none frees in time)
            async with replica.connection():
                if (body is None or isinstance(body, bytes)) and self.upstream.serves(replica.url):
                    answer = await self.upstream.request(route.method, replica.url, path, body, headers)
                    try:
                        response = await self._relay(request, parsed, target, answer, rewrite, usage,
                                                     evidence, replica, started)  # fmt: skip
                    finally:
                        answer.release()
                else:  # a multipart or very large body, or a replica this client cannot reach: aiohttp's
                    url = replica.url + path
                    async with self.pool.session.request(route.method, url, data=body, headers=headers) as up:
                        response = await self._relay(request, parsed, target, relay.AiohttpAnswer(up),
                                                     rewrite, usage, evidence, replica, started)  # fmt: skip
        if response.status == 200:
            self.scheduler.served(target, replica)
        return response

    async def _relay(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        target: Target,
        upstream: relay.Answer,
        rewrite: relay.Rewrite | None,
        usage: relay.Usage,
        evidence: dict[str, str],
        replica: Replica,
        started: float,
    ) -> web.StreamResponse:
        there = self.replica_names[replica.url]
        self.metrics.ttfb.observe(time.monotonic() - started)
        if target.role:  # a rollout runs: the first byte of this version's answer
            self.rollouts.first_byte(target, time.monotonic() - started)
            self.metrics.version_ttfb.labels(target.role).observe(time.monotonic() - started)
        if rewrite is not None and await rewrite.forgotten(upstream):
            raise VersionForgotten(
                f"replica {there} does not have {target.logical_id!r}'s "
                "version loaded (it restarted, or it was unloaded there); retry"
            )
        if upstream.status >= 500 and await self._went_down(replica):
            raise ReplicaGoingDown(
                f"replica {there} answered {upstream.status} as it went down (it answers no more): "
                "send the request again"
            )
        if parsed.route.kind == "model-card":
            name = target.version.name if target.version is not None else None
            return await relay.relay_card(upstream, name or parsed.model, target, evidence, there)
        if parsed.stream and upstream.content_type == "text/event-stream":
            return await relay.relay_stream(request, upstream, rewrite, usage, evidence, there)
        return await relay.relay_body(upstream, rewrite, usage, evidence, there)

    async def _went_down(self, replica: Replica) -> bool:
        """Whether a replica that answered a 5xx is going away: asked for its listing at once, it no
        longer answers (then its error is its shutdown's, not the request's)."""
        await self.pool.refresh(replica)
        return not replica.healthy


_FAULTS = (UpstreamError, NoEligibleReplica)
"""What counts as a version's error in a rollout's figures, beside a 5xx answer: a replica that failed
or answered badly, a load that failed (not a caller's bad input, nor a draining or busy kvgate)."""


def _rewrite(route: Route, name: str | None, logical_id: str) -> relay.Rewrite | None:
    """How ``model`` is rewritten coming out: this version's name, or any (a stored response)."""
    if name is not None:
        return relay.model_rewrite(name, logical_id)
    return relay.ANY_VERSION if route.kind == "response" else None
