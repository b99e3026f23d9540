"""Prometheus metrics, in one registry per app (no process-global default registry).

Labels stay bounded whatever the number of tenants: only counters made by ``_counter_by_id`` carry a
``logical_id`` label, and its value comes from ``for_request`` / ``for_id``: the ID itself for the top K
IDs by traffic, ``other`` for the rest (``top_ids`` says how IDs enter and leave the top K), ``unknown``
for a request that resolved to no servable ID. Histograms and gauges carry no logical ID. Replicas are
the configured URLs; outcomes, reasons and verdicts are small fixed sets. Adding a metric is one line
here: a plain ``Counter``/``Histogram``/``Gauge``, or ``self._counter_by_id(...)`` for a per-ID counter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway.telemetry.top_ids import DEFAULT_RERANK_INTERVAL, DEFAULT_TOP_K, OTHER, TopIds

UNKNOWN = "unknown"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

ID_LABEL = "logical_id"

__all__ = ["CONTENT_TYPE_LATEST", "ID_LABEL", "OTHER", "UNKNOWN", "Metrics"]


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        top_k: int = DEFAULT_TOP_K,
        rerank_interval: float = DEFAULT_RERANK_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.ids = TopIds(top_k, rerank_interval, self._drop_series, clock)
        self._by_id: list[Counter] = []
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        """(metric, label values) -> its child, bound once (``child``); dropped with its series."""
        r = self.registry
        self.requests = self._counter_by_id(
            "kvgate_requests", "Proxied requests by logical ID (top K, else other) and outcome", "outcome"
        )
        self.latency = Histogram(
            "kvgate_request_duration_seconds", "Whole request, to the last byte",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfb = Histogram(
            "kvgate_time_to_first_byte_seconds", "Request start to the backend's first byte",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.routing = Counter(
            "kvgate_routing_decisions", "How a replica was chosen", ["decision"], registry=r
        )
        self.prefix_matched_blocks = Histogram(
            "kvgate_prefix_matched_blocks",
            "Leading prompt blocks the chosen replica holds: by its KV events (precise) or by where kvgate "
            "sent prompts (predicted; blocks of 256 characters)",
            ["source"], buckets=(0, 1, 2, 4, 8, 16, 32, 64), registry=r,
        )  # fmt: skip
        self.kv_events = Counter(
            "kvgate_kv_events",
            "KV cache events received from a replica, by kind",
            ["replica", "kind"],
            registry=r,
        )
        self.prompt_unrendered = Counter(
            "kvgate_prompt_unrendered",
            "Prompts kvgate could not tokenize exactly as the replica will (routed on the predicted index), "
            "by reason",
            ["reason"],
            registry=r,
        )
        self.large_bodies = Counter(
            "kvgate_large_bodies",
            "Request bodies over 32 KiB, by what read them (read_by: the serving process's loop, or the body "
            "lane, which took it from the client's socket) and where they were parsed (parsed_in: the body "
            "lane's process; a worker thread, the lane having died; lost, the lane died holding it)",
            ["read_by", "parsed_in"],
            registry=r,
        )
        self.body_lane_starts = Counter(
            "kvgate_body_lane_starts",
            "Body lanes started (the first at the first large body; each next one replaces a lane that died)",
            registry=r,
        )
        self.kv_event_malformed = Counter(
            "kvgate_kv_events_malformed", "KV event messages or events that did not decode (skipped)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_event_gaps = Counter(
            "kvgate_kv_event_gaps",
            "Sequence gaps (or restarts) in a replica's KV events",
            ["replica"],
            registry=r,
        )
        self.kv_event_replays = Counter(
            "kvgate_kv_event_replays", "Gap repairs through the replica's replay socket, by outcome",
            ["replica", "outcome"], registry=r,
        )  # fmt: skip
        self.kv_view_resets = Counter(
            "kvgate_kv_view_resets", "Times a replica's precise view was emptied, by reason",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.kv_event_lag = Gauge(
            "kvgate_kv_event_lag_seconds", "Age of the last KV event batch from a replica when received",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_view_blocks = Gauge(
            "kvgate_kv_view_blocks", "Token blocks a replica holds by its KV events (the precise index)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_events_state = Gauge(
            "kvgate_kv_events_state",
            "1 for the state of a replica's KV events (following, partial, lost, unavailable), else 0",
            ["replica", "state"], registry=r,
        )  # fmt: skip
        self.routing_trust = Gauge(
            "kvgate_routing_trust",
            "1 for how far routing trusts what kvgate knows of a replica's cache (exact: every rank's KV "
            "events, its base's tokenizer and agreeing token counts; degraded: some ranks; predicted: the "
            "predicted index), else 0",
            ["replica", "trust"], registry=r,
        )  # fmt: skip
        self.kv_event_sources_skipped = Counter(
            "kvgate_kv_event_sources_skipped",
            "Entries of a replica's /kv_event_sources answer left out (malformed, or not followable)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.token_checks = Counter(
            "kvgate_token_checks",
            "Answers to prompts kvgate tokenized whole, by whether its token count equals the replica's "
            "usage.prompt_tokens (match, mismatch)",
            ["replica", "base", "result"], registry=r,
        )  # fmt: skip
        self.token_check_fallback = Gauge(
            "kvgate_token_check_fallback",
            "1 while a replica is routed on the predicted index because its token counts disagree",
            ["replica"], registry=r,
        )  # fmt: skip
        self.prefix_claimed_tokens = Counter(
            "kvgate_prefix_claimed_tokens",
            "Prompt tokens precise decisions claimed the chosen replica holds (matched blocks x its block "
            "size), in answers that reported cached_tokens",
            ["replica"], registry=r,
        )  # fmt: skip
        self.prefix_confirmed_tokens = Counter(
            "kvgate_prefix_confirmed_tokens",
            "Of the claimed tokens, those the answer's cached_tokens confirmed (confirmed / claimed: the "
            "precision of kvgate's view of the replica)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_event_dropped = Counter(
            "kvgate_kv_event_batches_dropped",
            "KV event batches dropped unread while a replica's events lagged (its view emptied meanwhile)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_event_errors = Counter(
            "kvgate_kv_event_follower_errors", "KV event follower failures (restarted after a pause)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.kv_event_batches = Counter(
            "kvgate_kv_event_batches",
            "KV event batches applied, by where they were read: c (kv._native, the plain case) or python "
            "(kv/events.py: a batch C does not take whole)",
            ["replica", "read_in"], registry=r,
        )  # fmt: skip
        self.loads = Counter(
            "kvgate_adapter_loads", "Adapter loads, by the scheduler's reason (loaded: a miss; spread: hot)",
            ["replica", "outcome", "reason"], registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "kvgate_adapter_load_seconds",
            "Adapter load latency",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unloads = Counter("kvgate_adapter_unloads", "Adapter unloads", ["replica", "reason"], registry=r)
        self.unloads_deferred = Counter(
            "kvgate_adapter_unloads_deferred", "Unloads of a retired version put off: a kvgate leases it "
            "(leased) or another kvgate is unloading it (unloading); tried again at the next sweep",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.agent_fetches = Counter(
            "kvgate_agent_fetches", "Asks to a replica's agent for a version's verified bytes, by outcome",
            ["replica", "outcome"], registry=r,
        )  # fmt: skip
        self.slot_line = Gauge(
            "kvgate_adapter_slot_line",
            "Loads in line for a slot on a replica, in one worker (the longest line): the one making room "
            "and those waiting for their turn", ["replica"], registry=r,
        )  # fmt: skip
        self.slot_wait = Histogram(
            "kvgate_adapter_slot_wait_seconds",
            "Time a load on a full budget took to get a slot: evicting an idle adapter, or waiting for one",
            ["replica"], buckets=(0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r,
        )  # fmt: skip
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
        self.base_print_changes = Counter(
            "kvgate_base_print_changes",
            "Times a replica's base fingerprint changed (another base under its name)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.base_mismatched = Gauge(
            "kvgate_base_mismatched_versions",
            "Current versions a replica may not serve: its base fingerprint differs from theirs",
            ["replica"],
            registry=r,
        )
        self.purges = Counter(
            "kvgate_prefix_purges", "purge-all prefix cache resets", ["replica", "outcome"], registry=r
        )
        self.epoch_changes = self._counter_by_id(
            "kvgate_epoch_changes", "Epoch changes seen by this kvgate's snapshot"
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
            "Full reads of the epoch table by reason: start, generation, trimmed (fell off the change log, "
            "or entries after the position were removed), rewound (the log's newest id is before the "
            "position: deleted, rewound, Redis restored from an older copy), checksum (the heartbeat's "
            "checksum disagreed)",
            ["reason"],
            registry=r,
        )
        self.snapshot_file = Counter(
            "kvgate_snapshot_file",
            "The local snapshot file: loaded (a start caught up from it), missing, written, write_failed, "
            "and why a start did not use it: corrupt (unreadable, truncated, damaged), foreign (another "
            "format), generation (another table or Redis), trimmed (the log no longer reaches it), ahead "
            "(the log ends before it), checksum (caught up, the rows disagree with the table)",
            ["outcome"],
            registry=r,
        )
        self.log_entries = Counter(
            "kvgate_table_log_entries",
            "Change-log entries applied to the snapshot, by action (drift: a write past the scripts)",
            ["action"],
            registry=r,
        )
        self.malformed_rows = Counter(
            "kvgate_malformed_rows",
            "Rows read from Redis that are not what kvgate writes, each skipped (its own problem, not the "
            "read's), by kind: change_log (an entry the follower skipped), state (a logical ID's state "
            "hash), caller (an API key)",
            ["kind"],
            registry=r,
        )
        self.staleness = Gauge(
            "kvgate_snapshot_staleness_seconds",
            "Seconds since the snapshot was last known current: it held every change the table had at that "
            "time (a full read, or a heartbeat whose newest change-log entry it had applied)",
            registry=r,
        )
        self.audits = self._counter_by_id(
            "kvgate_audit_verdicts", "Coherence audit verdicts", "replica", "verdict"
        )
        self.version_requests = self._counter_by_id(
            "kvgate_rollout_requests",
            "Requests of an ID whose rollout runs, by the version's role (current, candidate) and outcome "
            "(ok, error: a 5xx, a replica's failure, a failed load)", "role", "outcome",
        )  # fmt: skip
        self.version_ttfb = Histogram(
            "kvgate_rollout_time_to_first_byte_seconds",
            "Request start to the backend's first byte, for IDs whose rollout runs, by the version's role",
            ["role"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.rollout_aborts = self._counter_by_id(
            "kvgate_rollout_gate_aborts",
            "Rollouts the gate aborted, by why (incoherent, replica-mismatch, error-rate)", "reason",
        )  # fmt: skip
        self.cached_tokens = self._counter_by_id(
            "kvgate_backend_cached_tokens", "Prompt tokens the backend served from its prefix cache"
        )
        self.prompt_tokens = self._counter_by_id(
            "kvgate_backend_prompt_tokens", "Prompt tokens the backend reported"
        )

    KV_PREFIX = "kvgate_kv_"  # the KV indexer's series (``kv.indexer``): its page holds only these

    def without_kv_events(self) -> None:
        """This registry leaves the KV indexer's series to its page (``merge.PageCollector``): one
        family of each name on the page."""
        kv = (self.kv_events, self.kv_event_malformed, self.kv_event_gaps, self.kv_event_replays,
              self.kv_view_resets, self.kv_event_lag, self.kv_view_blocks, self.kv_events_state,
              self.kv_event_sources_skipped, self.kv_event_dropped, self.kv_event_errors,
              self.kv_event_batches)  # fmt: skip
        for metric in kv:
            self.registry.unregister(metric)

    def kv_page(self) -> bytes:
        """The KV indexer's page: its own series only (the rest of its registry is empty)."""
        lines = self.exposition().decode().splitlines()
        named = (line.removeprefix("# HELP ").removeprefix("# TYPE ") for line in lines)
        kept = [line for line, name in zip(lines, named, strict=True) if name.startswith(self.KV_PREFIX)]
        return ("\n".join(kept) + "\n").encode()

    def for_request(self, logical_id: str) -> str:
        """Count one request for ``logical_id`` in the traffic ranking; the label to count it under."""
        return self.ids.request(logical_id)

    def for_id(self, logical_id: str) -> str:
        """The label ``logical_id``'s counts go under right now: itself if promoted, else ``other``."""
        return self.ids.label(logical_id)

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, bound once: the request path asks for the same few children on
        every request (label values are bounded, see above, so this map is too)."""
        key = (metric, values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def _counter_by_id(self, name: str, documentation: str, *labels: str) -> Counter:
        """A counter labelled first by ``logical_id`` (always a value from ``for_request``/``for_id``)."""
        counter = Counter(name, documentation, [ID_LABEL, *labels], registry=self.registry)
        self._by_id.append(counter)
        return counter

    def _drop_series(self, logical_id: str) -> None:
        for counter in self._by_id:
            counter.remove_by_labels({ID_LABEL: logical_id})
        by_id = set(self._by_id)
        for metric, values in [key for key in self._children if key[0] in by_id and key[1][0] == logical_id]:
            del self._children[metric, values]

    def track_restarts(self, restarts: Callable[[], dict[str, int]]) -> None:
        """``kvgate_background_restarts_total{task}``: restarts of each supervised background task (its
        names are a fixed set: one per loop)."""
        self.registry.register(_Restarts(restarts))

    def track_staleness(self, staleness: Callable[[], float]) -> None:
        self.staleness.set_function(staleness)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Restarts(Collector):
    """The supervisor's restart counts, read at each scrape (the supervisor owns them)."""

    def __init__(self, restarts: Callable[[], dict[str, int]]) -> None:
        self.restarts = restarts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvgate_background_restarts", "Restarts of background tasks that failed, by task", labels=["task"]
        )
        for task, count in sorted(self.restarts().items()):
            family.add_metric([task], count)
        yield family
