"""What the request path writes on its span (``kvgate.proxy``): the target it resolved, the decision it
took. Nothing is computed when the span does not record (tracing off, or not sampled)."""

from __future__ import annotations

from opentelemetry.trace import Span

from gateway.core.model import Target
from gateway.core.scheduler import Decision
from gateway.fleet.replicas import Replica
from gateway.request.routes import Route
from gateway.telemetry import tracing as attr


def describe_target(span: Span, route: Route, target: Target, provider: str) -> None:
    if not span.is_recording():
        return
    span.set_attribute(attr.OPERATION, route.operation)
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


def describe_decision(span: Span, decision: Decision[Replica], target: Target) -> None:
    if not span.is_recording():
        return
    span.set_attribute(attr.REPLICA, decision.replica.url)
    span.set_attribute(attr.ROUTING, decision.reason)
    span.set_attribute(attr.MATCHED_BLOCKS, decision.matched_blocks)
    span.set_attribute(attr.PREDICTED_HIT, decision.matched_blocks > 0)
    span.set_attribute(attr.PREFIX_SOURCE, decision.prefix_source)
    if target.version is not None:
        loaded = decision.replica.listing.adapters.get(target.version.name, "")
        span.set_attribute(attr.REPLICA_LOADED, loaded)
