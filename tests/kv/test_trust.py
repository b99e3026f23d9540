"""A replica's routing trust as a worker sees it (``kv.trust.RoutingTrust``): the KV indexer's record of
its events (a real shared file, written as the indexer writes it), the worker's tokenizer for its base
and the worker's live check, met in one verdict on ``/healthz``, in ``kvgate_routing_trust`` and in the
start line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.fleet.backends.answers import AdapterListing
from gateway.fleet.replicas import Replica
from gateway.kv.live_check import MIN_CHECKED, LiveCheck
from gateway.kv.shared_index import SharedReader, SharedRegion, SharedWriter, create
from gateway.kv.tokenizers import Tokenizers
from gateway.kv.trust import RoutingTrust, predicted_line, track, untrack
from gateway.telemetry.metrics import Metrics
from tests.kv.test_tokenizers import TEXT, serving, trained

R0 = "http://r0:8000"


@pytest.fixture
def shared() -> Iterator[tuple[SharedWriter, SharedReader]]:
    fd = create(100, [R0])
    writer = SharedWriter(SharedRegion(fd, [R0]))
    writer.start(1)
    reader = SharedReader(SharedRegion(fd, [R0]))
    yield writer, reader
    writer.close()
    reader.region.close()
    os.close(fd)


def following(writer: SharedWriter) -> None:
    """The indexer's report of a replica whose every rank is followed (its follower's health)."""
    health: dict[str, object] = {"state": "following", "routing": "exact", "ranks": {"0": "following"},
                                 "settled": True}  # fmt: skip
    writer.report(R0, "following", health, 0.01, 3, None, 0)


def routing(metrics: Metrics, trust: str) -> float | None:
    return metrics.registry.get_sample_value("kvgate_routing_trust", {"replica": R0, "trust": trust})


async def test_a_replica_whose_base_has_no_tokenizer_is_trusted_as_predicted_with_the_reason(
    shared: tuple[SharedWriter, SharedReader],
) -> None:
    """Events or not, a replica whose base kvgate has no tokenizer for is routed on the predicted index:
    its trust says so with the reason, on ``/healthz`` and in ``kvgate_routing_trust``; the start line
    names it; it is settled (the start line need not wait for it)."""
    _, reader = shared
    tokenizers = Tokenizers.at_start("base", None, {})
    await tokenizers.learn([serving("base", None)])
    metrics = Metrics()
    live = LiveCheck(metrics, reader.block_size, window=50, max_mismatch=0.2)
    trust = RoutingTrust(reader, [serving("base", None, R0)], tokenizers, live)
    name, why = trust.of(R0)
    assert (name, why.split(":")[0]) == ("predicted", "no tokenizer for base base")
    assert trust.settled(R0)
    counts, detail = trust.health({R0: "r0"})
    assert (counts["unavailable"], counts["token_fallback"]) == (1, 0)
    shown = detail["r0"]
    assert isinstance(shown, dict)
    assert (shown["state"], shown["routing"], shown["routing_reason"]) == ("unavailable", "predicted", why)
    track(metrics, trust)
    assert (routing(metrics, "predicted"), routing(metrics, "exact")) == (1, 0)
    line = predicted_line(trust, {R0: "r0"}, "2 workers")
    assert "1 of 1 replicas" in str(line)
    assert "r0: no tokenizer for base base" in str(line)
    assert "kv_events is off" in str(predicted_line(None, {}, "2 workers"))


def test_the_workers_live_check_drops_a_followed_replica_to_predicted_and_lets_it_back(
    shared: tuple[SharedWriter, SharedReader], tmp_path: Path
) -> None:
    """The indexer says the replica's events are followed (exact); this worker's token counts disagree
    with its answers past the bound: predicted here, with the live check's reason, its window on
    ``/healthz`` and the fallback counted; once they agree again, exact again. The events' state is the
    indexer's, the verdict the worker's own."""
    writer, reader = shared
    model = trained(tmp_path / "model", TEXT, 300)
    tokenizers = Tokenizers.at_start("base", model, {})
    metrics = Metrics()
    live = LiveCheck(metrics, reader.block_size, window=2 * MIN_CHECKED, max_mismatch=0.2)
    replica = Replica(R0)
    replica.listing = AdapterListing("base", None)
    trust = RoutingTrust(reader, [replica], tokenizers, live)
    track(metrics, trust)
    assert (trust.of(R0)[0], trust.settled(R0)) == ("predicted", False), "nothing reported yet"
    following(writer)
    assert trust.of(R0) == ("exact", "")
    assert trust.settled(R0)
    for _ in range(MIN_CHECKED):
        live.answered(R0, "base", counted=10, reported=11, precise_blocks=0, cached=None)
    name, why = trust.of(R0)
    assert (name, why.split(":")[0]) == ("predicted", "token counts disagree")
    counts, detail = trust.health({R0: "r0"})
    assert (counts["following"], counts["token_fallback"]) == (1, 1)
    shown = detail["r0"]
    assert isinstance(shown, dict)
    assert (shown["state"], shown["routing"], shown["routing_reason"]) == ("following", "predicted", why)
    assert shown["token_check"] == {"checked": MIN_CHECKED, "mismatched": MIN_CHECKED, "fallback": True}
    assert "settled" not in shown, "the indexer's note for the start line stays off /healthz"
    assert routing(metrics, "predicted") == 1
    for _ in range(4 * MIN_CHECKED):  # the window fills with agreeing answers
        live.answered(R0, "base", counted=10, reported=10, precise_blocks=0, cached=None)
    assert trust.of(R0) == ("exact", "")
    assert routing(metrics, "exact") == 1
    assert predicted_line(trust, {R0: "r0"}, "2 workers") is None
    untrack(metrics)  # at the stop, before the shared table is closed: nothing reads it any more
    assert routing(metrics, "exact") is None
