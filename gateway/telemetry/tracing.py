"""OpenTelemetry: a tracer built from the standard ``OTEL_*`` variables, off by default.

``OTEL_TRACES_EXPORTER`` = ``none`` (default) | ``console`` | ``otlp`` (comma-separated for several);
the OTLP exporter (HTTP/protobuf) reads ``OTEL_EXPORTER_OTLP_ENDPOINT`` and friends itself, and the
resource reads ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``. Attribute names follow the GenAI
semantic conventions where they exist (``gen_ai.*``); kvgate's own are under ``kvgate.*``.
"""

from __future__ import annotations

import os

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import NoOpTracer, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

INSTRUMENTATION = "kvgate"
_PROPAGATOR = TraceContextTextMapPropagator()

# GenAI semantic conventions
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
# kvgate's own
LOGICAL_ID = "kvgate.logical_id"
VERSION_NAME = "kvgate.version.name"
VERSION_DIGEST = "kvgate.version.digest"
EPOCH = "kvgate.epoch"
BASE = "kvgate.base_model"
REPLICA = "kvgate.replica"
REPLICA_LOADED = "kvgate.replica.loaded_root"
ROUTING = "kvgate.routing.decision"
BLOCK_KEY = "kvgate.prefix.block_key"
MATCHED_BLOCKS = "kvgate.prefix.matched_blocks"
PREDICTED_HIT = "kvgate.prefix.predicted_hit"
PREFIX_SOURCE = "kvgate.prefix.source"  # where matched_blocks comes from: precise | predicted | none
CACHED_TOKENS = "kvgate.backend.cached_tokens"
OUTCOME = "kvgate.outcome"
UNLOAD_REASON = "kvgate.unload.reason"


def tracer_provider_from_env() -> TracerProvider | None:
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    exporters = [_exporter(name) for name in names if name != "none"]
    if not exporters:
        return None
    service = os.environ.get("OTEL_SERVICE_NAME") or "kvgate"  # explicit attributes would override the env
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (use none, console or otlp)")


def tracer_from(provider: TracerProvider | None) -> Tracer:
    return provider.get_tracer(INSTRUMENTATION) if provider is not None else NoOpTracer()


def inject_traceparent(headers: dict[str, str], context: Context | None = None) -> None:
    """W3C ``traceparent`` (and ``tracestate``) of the current span, for the backend request."""
    _PROPAGATOR.inject(headers, context=context)
