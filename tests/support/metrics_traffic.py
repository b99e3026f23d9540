"""What the request path records in a ``Metrics`` per request, replayed without the proxy, and the size of
the exposition it yields: for the cardinality tests and ``loadtest/metrics_cardinality.py``.

``record_request`` makes the calls ``Proxy.handle``/``Proxy.forward`` (request count, latency, time to
first byte), ``relay.Usage`` (prompt and cached tokens) and the canary (one verdict per replica) make for
one served request; ``record_epoch_change`` the one ``app._epoch_changed`` makes. The end-to-end test
(``tests/telemetry/test_metrics_cardinality.py``) checks the real call sites against a running kvgate.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metrics import ID_LABEL, Metrics

REPLICAS = ("http://10.0.0.5:8000", "http://10.0.0.6:8000")


def record_request(metrics: Metrics, logical_id: str, outcome: str = "200") -> None:
    label = metrics.for_request(logical_id)
    metrics.requests.labels(label, outcome).inc()
    metrics.latency.observe(0.2)
    metrics.ttfb.observe(0.05)
    usage = metrics.for_id(logical_id)
    metrics.prompt_tokens.labels(usage).inc(100)
    metrics.cached_tokens.labels(usage).inc(64)
    for replica in REPLICAS:
        metrics.audits.labels(metrics.for_id(logical_id), replica, "coherent").inc()


def record_epoch_change(metrics: Metrics, logical_id: str) -> None:
    metrics.epoch_changes.labels(metrics.for_id(logical_id)).inc()


def series_in(exposition: bytes) -> int:
    """The sample lines of an exposition (what Prometheus stores as series; ``_created`` lines too)."""
    return sum(1 for line in exposition.splitlines() if line and not line.startswith(b"#"))


@dataclass(frozen=True)
class Exposition:
    """One ``/metrics`` text, parsed: its size, its series, and the values per metric and label set."""

    size: int
    series: int
    families: dict[str, str]
    """Metric family name -> its type (counter, histogram, gauge)."""
    by_id: set[str]
    """The metric families with a ``logical_id`` label on any sample."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]]
    """Sample name (``kvgate_requests_total``) -> sorted label pairs -> value."""

    @classmethod
    def parse(cls, text: bytes) -> Exposition:
        families: dict[str, str] = {}
        by_id: set[str] = set()
        samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        series = 0
        for family in text_string_to_metric_families(text.decode()):
            families[family.name] = family.type
            for sample in family.samples:
                series += 1
                samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
                if ID_LABEL in sample.labels:  # a counter's X_created samples parse as a family of their own
                    by_id.add(family.name.removesuffix("_created"))
        return cls(len(text), series, families, by_id, samples)

    def ids(self, sample: str) -> dict[str, float]:
        """``logical_id`` label value -> the sum of ``sample`` over its other labels."""
        totals: dict[str, float] = {}
        for labels, value in self.samples.get(sample, {}).items():
            label = dict(labels).get(ID_LABEL)
            if label is not None:
                totals[label] = totals.get(label, 0.0) + value
        return totals
