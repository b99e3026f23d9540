"""Prometheus metrics, in one registry per app (no process-global default registry).

Labels stay bounded: a logical ID label is only ever a published ID (unknown models count as
``unknown``), replicas are the configured URLs, outcomes and verdicts are small fixed sets.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

UNKNOWN = "unknown"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

__all__ = ["CONTENT_TYPE_LATEST", "UNKNOWN", "Metrics"]


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate_requests",
            "Proxied requests by logical ID and outcome",
            ["logical_id", "outcome"],
            registry=r,
        )
        self.latency = Histogram(
            "kvgate_request_duration_seconds", "Whole request, to the last byte", ["logical_id"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfb = Histogram(
            "kvgate_time_to_first_byte_seconds", "Request start to the backend's first byte", ["logical_id"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.routing = Counter(
            "kvgate_routing_decisions", "How a replica was chosen", ["decision"], registry=r
        )
        self.prefix_matched_blocks = Histogram(
            "kvgate_prefix_matched_blocks", "Leading prompt blocks the chosen replica was predicted to hold",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64), registry=r,
        )  # fmt: skip
        self.loads = Counter("kvgate_adapter_loads", "Adapter loads", ["replica", "outcome"], registry=r)
        self.load_seconds = Histogram(
            "kvgate_adapter_load_seconds",
            "Adapter load latency",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unloads = Counter("kvgate_adapter_unloads", "Adapter unloads", ["replica", "reason"], registry=r)
        self.quarantines = Counter(
            "kvgate_quarantines", "Adapters quarantined on a replica (its listing or the canary disagreed)",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.quarantined = Gauge(
            "kvgate_quarantined_adapters",
            "Adapters quarantined right now, per replica",
            ["replica"],
            registry=r,
        )
        self.purges = Counter(
            "kvgate_prefix_purges", "purge-all prefix cache resets", ["replica", "outcome"], registry=r
        )
        self.epoch_changes = Counter(
            "kvgate_epoch_changes", "Epoch changes seen by this kvgate's snapshot", ["logical_id"], registry=r
        )
        self.new_generations = Counter(
            "kvgate_table_new_generations",
            "Times the epoch table came back empty (a new generation) under this kvgate's snapshot",
            registry=r,
        )
        self.reseeded_versions = Counter(
            "kvgate_table_reseeded_versions",
            "After a new generation, per logical ID the snapshot held: reseeded, already_present, unproven",
            ["outcome"],
            registry=r,
        )
        self.full_reads = Counter(
            "kvgate_table_full_reads",
            "Full reads of the epoch table by reason: start, generation, trimmed (fell off the change log), "
            "checksum (the heartbeat's checksum disagreed)",
            ["reason"],
            registry=r,
        )
        self.log_entries = Counter(
            "kvgate_table_log_entries",
            "Change-log entries applied to the snapshot, by action (drift: a write past the scripts)",
            ["action"],
            registry=r,
        )
        self.staleness = Gauge(
            "kvgate_snapshot_staleness_seconds",
            "Seconds since the snapshot was last confirmed current (a full read or a heartbeat)",
            registry=r,
        )
        self.audits = Counter(
            "kvgate_audit_verdicts",
            "Coherence audit verdicts",
            ["logical_id", "replica", "verdict"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvgate_backend_cached_tokens", "Prompt tokens the backend served from its prefix cache",
            ["logical_id"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvgate_backend_prompt_tokens", "Prompt tokens the backend reported", ["logical_id"], registry=r
        )

    def track_staleness(self, staleness: Callable[[], float]) -> None:
        self.staleness.set_function(staleness)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
