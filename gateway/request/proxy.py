"""The OpenAI-compatible request path, in stages, in order: ``Proxy.handle`` is one call per stage.

1. authorize: who is asking, from its API key or admin token, before the body is read (``auth``)
2. parse: the body read once as the route's kind says; a follow-up pinned to its replica (``intake``)
3. resolve: what the request names: a base model or a logical ID's entry in the snapshot (``stages``)
4. split: which version answers: the current one, or a rollout's candidate (``stages``, ``core/split``)
5. tokenize: its cache namespace, prefix keys and tokens: the ``Target`` (``stages``)
6. decide: the scheduler asked once where it runs, carried out under its reservation (``placement``)
7. forward: the body with the gateway's members spliced in, sent to that replica (``Proxy.forward``)
8. relay: the answer back, ``model`` rewritten to the logical ID, usage read (``relay``)
9. account: the request's count, latency, its rollout's figures and the live check of its answer
   (``Proxy.account``, ``kv.live_check``)

Every vLLM model route (``routes.ROUTES``) takes this one path. Going in, ``model`` is rewritten from
the logical ID to the versioned name and the gateway sets the cache namespace where the route takes one
(the client's ``cache_salt`` is never forwarded); coming out, the versioned name is rewritten back and
headers say which effective model answered. Every eligibility rule is the scheduler's; decide is asked
again only on the retries ``serve`` and ``Placement.place`` document (the replica went down before the
first byte, or forgot the version). No Redis command runs here: the snapshot (and the API key copy) is
local. Each request leaves one span and its metrics. With API keys on, what a caller may not use
resolves as not found, the base model runs in the caller's tenant namespace, and the caller's
``Authorization`` (kvgate's credential) never goes on to a replica.
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
from gateway.core.model import Target
from gateway.core.prefix import BLOCK_CHARS, PREFIX_CHARS
from gateway.core.scheduler import Decision, Scheduler
from gateway.core.wire import AUTHORIZATION_HEADER, replica_id
from gateway.fleet.backends import BackendDialect
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.fleet.reservation import Reservation
from gateway.kv.live_check import LiveCheck
from gateway.kv.tokenizers import Tokenizers
from gateway.request import relay, spans
from gateway.request.admin import Admin
from gateway.request.auth import Auth
from gateway.request.body_lane import HeldUpstream
from gateway.request.intake import Intake, ParsedRequest, chunked, upstream_body
from gateway.request.placement import Placement
from gateway.request.routes import Route
from gateway.request.stages import Keying, Targeting
from gateway.request.upstream import Upstream
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
    tokens: Tokenizers | None = None  # each base's tokenizer: precise prefix keys (KV events)
    connect_timeout: float = 5.0  # the forward's client (``upstream``): TCP connect
    read_timeout: float = 600.0  # and between received bytes


@dataclass(slots=True)
class Accounting:
    """What stage 9 (account) counts, filled in as the request goes: its metric label, its outcome (the
    status, or the error's type), its target once resolved, whether it failed as a version's fault, and
    the answer relayed whole with status 200 (what the live check compares)."""

    started: float
    label: str = UNKNOWN
    outcome: str = "error"
    target: Target | None = None
    fault: bool = False
    answered: Outbound | None = None


@dataclass(slots=True)
class Outbound:
    """What stage 7 (forward) hands stage 8 (relay) beside the answer: the replica it went to and what
    responses call it, how ``model`` is rewritten coming out, where usage is counted, the evidence, the
    decision that chose the replica."""

    replica: Replica
    there: str
    rewrite: relay.Rewrite | None
    usage: relay.Usage
    evidence: dict[str, str]
    decision: Decision[Replica]


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
        live: LiveCheck | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.live = live
        """The live check of answers against what kvgate computed (with a tokenizer and KV events)."""
        self.rollouts = rollouts if rollouts is not None else RolloutStats()
        """Per-version figures of the running rollouts (the gate reads them)."""
        self.pool = pool
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
        choosing = len(pool.replicas) > 1
        """More than one replica could serve a request: only then do prefix keys and tokens decide
        anything. With one, a request is keyed by its first block only (the ``x-kvgate-prefix-key``
        evidence the audit records) and never tokenized."""
        keying = Keying(
            PREFIX_CHARS if choosing else BLOCK_CHARS,
            options.tokens if choosing and scheduler.precise is not None else None,
        )
        parse_with = keying.tokens.for_base(options.base_model) if keying.tokens is not None else None
        self.intake = Intake(  # stages 1, 2; a large body is tokenized where it is parsed, by base_model's
            admin, pool.replicas, options.max_body_bytes, parse_with, metrics,  # tokenizer if known at start
            options.read_timeout,  # the body lane's writes to a replica, as the forward's reads
        )  # fmt: skip
        self.targeting = Targeting(  # stages 3 to 5
            snapshot,
            pool,
            keying,
            metrics,
            base_model=options.base_model,
            base_identity=options.base_identity,
        )
        self.placement = Placement(pool, scheduler, loader, leases)  # stage 6, with the loader and leases
        self.upstream = Upstream(options.connect_timeout, options.read_timeout)  # stage 7's client

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        """The request path, one call per stage (the module's docstring says what each does)."""
        counts = Accounting(time.monotonic())
        spanning = self._span() if self.tracing else contextlib.nullcontext(INVALID_SPAN)
        parsed: ParsedRequest | None = None
        with spanning as span:
            try:
                caller = self.auth.caller(request)  # 1 authorize
                parsed = await self.intake.parse(request, route, caller)  # 2 parse
                named = self.targeting.resolve(parsed, caller)  # 3 resolve
                chosen = self.targeting.split(named, parsed, caller)  # 4 split
                target = counts.target = self.targeting.tokenize(named, chosen, parsed)  # 5 tokenize
                self._began(counts, target, route, span)
                response = await self.serve(request, parsed, target, span, counts)  # 6, 7, 8
                counts.outcome, counts.fault = str(response.status), response.status >= 500
                return response
            except KvgateError as exc:
                counts.outcome, counts.fault = exc.type, isinstance(exc, _FAULTS)
                exc.message = relay.public_message(exc.message, self.replica_names)  # no URL, no version
                span.set_status(StatusCode.ERROR, exc.message)
                raise
            except asyncio.CancelledError:  # the client left (aiohttp cancels its handler), or shutdown
                counts.outcome = ClientClosed.type
                raise
            finally:
                self.account(counts)  # 9 account
                if parsed is not None and parsed.held is not None:
                    parsed.held.release()  # the body lane drops the body it held

    def _span(self) -> contextlib.AbstractContextManager[Span]:
        return self.tracer.start_as_current_span("kvgate.proxy", kind=SpanKind.SERVER)

    def _began(self, counts: Accounting, target: Target, route: Route, span: Span) -> None:
        """The target known: its metric label, its ID active (the canary), its span described."""
        counts.label = self.metrics.for_request(target.logical_id)
        if target.version is not None:
            self.activity[target.logical_id] = counts.started
        spans.describe_target(span, route, target, self.dialect.name)

    def account(self, counts: Accounting) -> None:
        """Stage 9: the request counted by outcome, its latency, while a rollout runs its version's
        figures (the gate compares them), and the answer checked live against what kvgate computed (its
        token count, its precise match: ``kv.live_check``)."""
        metrics, target = self.metrics, counts.target
        metrics.child(metrics.requests, counts.label, counts.outcome).inc()
        metrics.latency.observe(time.monotonic() - counts.started)
        if target is not None and target.role:
            self.rollouts.finished(target, error=counts.fault)
            metrics.version_requests.labels(
                counts.label, target.role, "error" if counts.fault else "ok"
            ).inc()
        answered = counts.answered
        if answered is not None and target is not None and self.live is not None:
            decision, usage = answered.decision, answered.usage
            self.live.answered(
                answered.replica.url,
                answered.replica.base or target.base,
                counted=len(target.tokens) if target.whole else None,
                reported=usage.prompt,
                precise_blocks=decision.matched_blocks if decision.prefix_source == "precise" else 0,
                cached=usage.cached,
            )

    async def serve(
        self, request: web.Request, parsed: ParsedRequest, target: Target, span: Span, counts: Accounting
    ) -> web.StreamResponse:
        """Stages 6 to 8 (decide, forward, relay), under the request's ``Reservation`` from the decision to
        the last byte. The documented retries, the only times decide is asked again: a replica that
        fails before the first byte reaches the client is marked unhealthy (until its next good poll)
        and the request goes to the next eligible one (pinned requests are never moved); a replica that
        answers it does not have the version (``VersionForgotten``) is looked at again and the request
        retried once (the version is loaded there again). After the first byte, errors travel as a final
        SSE event instead. A client that leaves (``ClientClosed``) or a replica without a free connection
        (``ReplicaBusy``) is no fault of the replica: neither marks it nor retries."""
        pin = parsed.admin.pin
        attempts, forgotten = len(self.pool.replicas), False
        while True:
            decision, reservation = await self.decide(target, pin, span)
            try:
                return await self.forward(request, parsed, target, reservation, decision, span, counts)
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

    async def decide(
        self, target: Target, pin: Replica | None, span: Span
    ) -> tuple[Decision[Replica], Reservation]:
        """Stage 6: the scheduler's decision carried out, under the request's reservation
        (``placement``), and written on the span and the routing metrics."""
        decision, reservation = await self.placement.place(target, pin)
        spans.describe_decision(span, decision, target)
        metrics = self.metrics
        metrics.child(metrics.routing, decision.reason).inc()
        matched = metrics.child(metrics.prefix_matched_blocks, decision.prefix_source)
        matched.observe(decision.matched_blocks)
        return decision, reservation

    async def forward(  # stage 7
        self,
        request: web.Request,
        parsed: ParsedRequest,
        target: Target,
        reservation: Reservation,
        decision: Decision[Replica],
        span: Span,
        counts: Accounting,
    ) -> web.StreamResponse:
        """Stage 7: the body with the gateway's members spliced in (``intake.upstream_body``) sent to the
        replica decided on, holding one of its connection slots to the last byte relayed (``ReplicaBusy``
        if none frees in time); its answer goes to stage 8 with what relaying it needs (``Outbound``),
        and once relayed whole with status 200, to stage 9 (``counts.answered``)."""
        replica, started = reservation.replica, counts.started
        route = parsed.route
        body = upstream_body(parsed, target, replica.url, self.dialect, namespaces=self.options.namespaces)
        json_body = isinstance(body, bytes | io.BytesIO | HeldUpstream)
        headers = {"Content-Type": "application/json"} if json_body else {}
        if AUTHORIZATION_HEADER in request.headers and not self.auth.on:  # with keys on: kvgate's, not theirs
            headers[AUTHORIZATION_HEADER] = request.headers[AUTHORIZATION_HEADER]
        if self.tracing:
            attr.inject_traceparent(headers)
        there = self.replica_names[replica.url]
        out = Outbound(
            replica,
            there,
            _rewrite(route, target.version.name if target.version is not None else None, target.logical_id),
            relay.Usage(self.metrics, self.metrics.for_id(target.logical_id), span),
            wire.evidence(target, there, decision.prefix_source, decision.matched_blocks),
            decision,
        )
        path = "/v1/models" if route.kind == "model-card" else request.path_qs  # vLLM has no models/{id}
        with relay.UpstreamErrors(there):
            async with replica.connection():
                ours = self.upstream.serves(replica.url)
                if isinstance(body, HeldUpstream) and not ours:  # aiohttp's client sends it, from here
                    body = chunked(await body.fetch())
                if isinstance(body, HeldUpstream) or ((body is None or isinstance(body, bytes)) and ours):
                    if isinstance(body, HeldUpstream):  # the body lane writes it
                        via = self.upstream.request_via(route.method, replica.url, path, headers, body.write)
                    else:
                        via = self.upstream.request(route.method, replica.url, path, body, headers)
                    answer = await via
                    try:
                        response = await self.relay(request, parsed, target, answer, out, started)
                    finally:
                        answer.release()
                else:  # a multipart or very large body, or a replica this client cannot reach: aiohttp's
                    url = replica.url + path
                    async with self.pool.session.request(route.method, url, data=body, headers=headers) as up:
                        response = await self.relay(
                            request, parsed, target, relay.AiohttpAnswer(up), out, started
                        )
        if response.status == 200:
            self.scheduler.served(target, replica)
            counts.answered = out
        return response

    async def relay(  # stage 8
        self,
        request: web.Request,
        parsed: ParsedRequest,
        target: Target,
        upstream: relay.Answer,
        out: Outbound,
        started: float,
    ) -> web.StreamResponse:
        """Stage 8: the replica's answer back to the client (``relay``): ``model`` rewritten to the logical
        ID, usage read, the evidence headers; a replica that forgot the version or is going down is
        raised for ``serve`` to retry."""
        replica, there, rewrite = out.replica, out.there, out.rewrite
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
            return await relay.relay_card(upstream, name or parsed.model, target, out.evidence, there)
        if parsed.stream and upstream.content_type == "text/event-stream":
            return await relay.relay_stream(request, upstream, rewrite, out.usage, out.evidence, there)
        return await relay.relay_body(upstream, rewrite, out.usage, out.evidence, there)

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
