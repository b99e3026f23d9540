"""The one scheduler, on plain replica objects: prefix keys, the index, filters, scorers and the pick."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from gateway.core.errors import NoEligibleReplica
from gateway.core.model import Target, VersionState
from gateway.core.prefix import BLOCK_CHARS, PrefixIndex, block_keys, content_keys, prompt_text
from gateway.core.scheduler import Scheduler, eligible, evictions, has_room, holds, within_bound
from gateway.fleet.backends import AdapterListing
from gateway.fleet.replicas import Replica
from gateway.kv.events import BlockStored
from gateway.kv.index import PreciseIndex

TEXT = "".join(f"sentence {i} of a long shared system prompt. " for i in range(60))
VERSION = VersionState("t", "d" * 64, "t@dddddddddddddddd", "/store/" + "d" * 64, "base", 1)


def replicas(count: int, *, holding: bool = True) -> list[Replica]:
    made = [Replica(f"http://r{i}") for i in range(count)]
    for replica in made:
        replica.healthy = True
        replica.listing = AdapterListing("base", "/m", {VERSION.name: VERSION.path} if holding else {})
    return made


def target(seed: str = "kvg-a", version: VersionState | None = VERSION) -> Target:
    return Target("t", "base", version, seed, block_keys(seed, content_keys(TEXT)))


def test_keys_chain_over_full_blocks_and_depend_on_the_namespace() -> None:
    keys = block_keys("kvg-a", content_keys(TEXT))
    assert len(keys) == len(TEXT) // BLOCK_CHARS
    assert block_keys("kvg-a", content_keys(TEXT + " and a new question"))[: len(keys)] == keys
    assert not set(block_keys("kvg-b", content_keys(TEXT))) & set(keys), "another namespace never matches"
    assert prompt_text({"messages": [{"role": "user", "content": "x"}]}) == '[{"content":"x","role":"user"}]'


def test_index_matches_leading_blocks_and_forgets_least_recent() -> None:
    keys = block_keys("kvg-a", content_keys(TEXT))
    index = PrefixIndex(capacity=len(keys))
    index.record(keys[:3], "http://r0")
    assert index.matched(keys, "http://r0") == 3
    assert index.matched(keys, "http://r1") == 0
    index.record(block_keys("kvg-b", content_keys(TEXT)), "http://r1")  # pushes the older entries out
    assert index.matched(keys, "http://r0") == 0


def test_longest_prefix_wins_and_is_recorded_by_the_scheduler() -> None:
    pool = replicas(3)
    scheduler = Scheduler(index_entries=1000)
    wanted = target()
    scheduler.index.record(wanted.keys[:2], pool[0].url)
    scheduler.served(wanted, pool[2])
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.action, decision.reason) == (pool[2], "serve", "prefix")
    assert decision.matched_blocks == len(wanted.keys)


def test_a_prefix_held_everywhere_goes_to_one_replica_whatever_the_order_and_load() -> None:
    pool = replicas(3)
    scheduler = Scheduler(index_entries=10_000)
    wanted = target()
    for replica in pool:
        scheduler.served(wanted, replica)
    chosen = {scheduler.decide(list(order), wanted).replica.url for order in itertools.permutations(pool)}
    assert len(chosen) == 1, "the tie-break does not depend on the order replicas are listed in"
    holder = next(r for r in pool if r.url in chosen)
    for replica in [*pool, *pool, holder]:  # 2 in flight each, 3 on the holder: within its bounded share
        replica.begin(VERSION.name)
    assert scheduler.decide(pool, wanted).replica is holder, "load within the bound does not move a prefix"


def test_ties_spread_different_prefixes_over_replicas() -> None:
    pool = replicas(3)
    scheduler = Scheduler(index_entries=100_000)
    chosen = set()
    for tenant in range(30):
        wanted = target(f"kvg-{tenant}")
        for replica in pool:
            scheduler.served(wanted, replica)
        chosen.add(scheduler.decide(pool, wanted).replica.url)
    assert chosen == {r.url for r in pool}, "rendezvous ties do not send every tenant to one replica"


def test_bounded_load_skips_an_overloaded_holder() -> None:
    pool = replicas(2)
    scheduler = Scheduler(index_entries=1000)
    wanted = target()
    scheduler.served(wanted, pool[0])
    for _ in range(4):
        pool[0].begin("x")
    assert within_bound(pool) == [pool[1]]
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.reason) == (pool[1], "least-loaded")


def test_no_holder_means_load_on_the_least_loaded_replica_of_the_base() -> None:
    pool = replicas(3, holding=False)
    pool[0].begin(None)
    pool[2].listing = AdapterListing("other-base", "/m", {})
    decision = Scheduler(index_entries=10).decide(pool, target())
    assert (decision.replica, decision.action, decision.reason) == (pool[1], "load", "loaded")


def test_pinned_serves_or_loads_on_the_pin_only() -> None:
    pool = replicas(2)
    pool[1].listing = AdapterListing("base", "/m", {})
    scheduler = Scheduler(index_entries=10)
    serve = scheduler.decide(pool, target(), pin=pool[0].url)
    assert (serve.replica, serve.action, serve.reason) == (pool[0], "serve", "pinned")
    load = scheduler.decide(pool, target(), pin=pool[1].url)
    assert (load.replica, load.action) == (pool[1], "load")
    pool[1].healthy = False
    with pytest.raises(NoEligibleReplica, match="r1 is unhealthy"):
        scheduler.decide(pool, target(), pin=pool[1].url)


def test_nothing_of_the_base_is_a_clear_error_and_base_requests_need_no_version() -> None:
    pool = replicas(2)
    with pytest.raises(NoEligibleReplica, match="'other'"):
        Scheduler(index_entries=10).decide(pool, Target("t", "other", VERSION, None, []))
    base_request = Scheduler(index_entries=10).decide(pool, Target("base", "base", None, None, []))
    assert (base_request.action, base_request.reason) == ("serve", "least-loaded")


def test_evictions_never_offer_a_name_in_use_and_take_retired_then_least_recent() -> None:
    order = evictions(
        ["cur-old", "cur-new", "retired", "busy"],
        in_use={"busy": 1},
        current={"cur-old", "cur-new", "busy"},
        last_used={"cur-old": 1.0, "cur-new": 5.0, "retired": 9.0, "busy": 0.0},
    )
    assert order == ["retired", "cur-old", "cur-new"]


def room_of(budget: int) -> Callable[[Replica], bool]:
    """The one idea of room (``has_room``), with every listed adapter counted as kvgate's, none pending."""
    return lambda r: has_room(list(r.listing.adapters), 0, r.in_flight_by_name, budget)


def test_a_hot_version_spreads_to_an_idle_replica_with_room() -> None:
    pool = replicas(3, holding=False)
    holder, idle, full = pool
    holder.listing = AdapterListing("base", "/m", {VERSION.name: VERSION.path})
    full.listing = AdapterListing("base", "/m", {f"other@{i}": "/x" for i in range(2)})
    full.in_flight_by_name.update(dict.fromkeys(full.listing.adapters, 1))  # all in use: no room
    scheduler, room = Scheduler(index_entries=10), room_of(2)
    assert scheduler.decide(pool, target(), room=room).action == "serve", "one request does not spread"
    for _ in range(2):
        holder.begin(VERSION.name)
    decision = scheduler.decide(pool, target(), room=room)
    assert (decision.replica, decision.action, decision.reason) == (idle, "load", "spread")
    idle.listing = AdapterListing("base", "/m", {f"other@{i}": "/x" for i in range(2)})
    idle.in_flight_by_name.update(dict.fromkeys(idle.listing.adapters, 1))
    stays = scheduler.decide(pool, target(), room=room)
    assert (stays.replica, stays.action) == (holder, "serve"), "no replica with room: the holder serves"


def test_room_is_a_free_slot_or_an_idle_adapter_and_a_load_goes_where_there_is_room() -> None:
    assert has_room(["a"], 0, {}, 2)
    assert has_room(["a"], 1, {}, 3)
    assert not has_room(["a"], 1, {"a": 1}, 2), "a pending load takes the free slot"
    assert has_room(["a", "b"], 0, {"a": 1}, 2), "an idle adapter may be evicted"
    pool = replicas(3, holding=False)
    busy_full, busier_free, busiest = pool
    busy_full.listing = AdapterListing("base", "/m", {"other@0": "/x"})
    busy_full.in_flight_by_name["other@0"] = 1
    for _ in range(2):
        busier_free.begin(None)
    for _ in range(3):
        busiest.begin(None)
    load = Scheduler(index_entries=10).decide(pool, target(), room=room_of(1))
    assert (load.replica, load.action, load.reason) == (busier_free, "load", "loaded")
    for replica in pool:
        replica.listing = AdapterListing("base", "/m", {"other@0": "/x"})
        replica.in_flight_by_name["other@0"] = 1
    waits = Scheduler(index_entries=10).decide(pool, target(), room=room_of(1))
    assert (waits.replica, waits.action) == (busy_full, "load"), "no room anywhere: the least-loaded waits"


# --- the precise index (KV events) first, then the predicted one, then load ----------------------

TOKENS = tuple(range(1000, 1000 + 4 * 128 + 7))


def precise_target(version: VersionState | None = VERSION, salt: str = "kvg-a") -> Target:
    return Target("t", "base", version, salt, block_keys(salt, content_keys(TEXT)), tokens=TOKENS)


def stored(namespace: tuple[str | None, str | None], blocks: int, first_hash: int = 1) -> BlockStored:
    name, salt = namespace
    extra = (tuple(x for x in (name, salt) if x), *([(name,) if name else None] * (blocks - 1)))
    hashes = tuple(range(first_hash, first_hash + blocks))
    return BlockStored(hashes, None, TOKENS[: blocks * 128], 128, name, extra)


def test_the_longest_precise_match_wins_over_the_predicted_one() -> None:
    pool = replicas(3)
    index = PreciseIndex(1000)
    scheduler = Scheduler(index_entries=1000, precise=index)
    wanted = precise_target()
    scheduler.served(wanted, pool[0])  # predicted: r0 holds the whole prompt
    index.apply(pool[1].url, [stored((VERSION.name, "kvg-a"), 2)])
    index.apply(pool[2].url, [stored((VERSION.name, "kvg-a"), 4)])
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.reason, decision.prefix_source) == (pool[2], "prefix", "precise")
    assert decision.matched_blocks == 4


class Distrusting:
    """A ``TokenTrust`` (``kv.live_check.LiveCheck`` in kvgate) that distrusts the replicas named."""

    def __init__(self, *urls: str) -> None:
        self.urls = set(urls)

    def exact(self, replica: str) -> bool:
        return replica not in self.urls


def test_a_replica_whose_token_counts_disagree_is_routed_as_predicted() -> None:
    pool = replicas(3)
    index = PreciseIndex(1000)
    trust = Distrusting(pool[2].url)
    scheduler = Scheduler(index_entries=1000, precise=index, trust=trust)
    wanted = precise_target()
    scheduler.served(wanted, pool[0])  # predicted: r0 holds the whole prompt
    index.apply(pool[1].url, [stored((VERSION.name, "kvg-a"), 2)])
    index.apply(pool[2].url, [stored((VERSION.name, "kvg-a"), 4)])  # the longest, by untrusted events
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.prefix_source, decision.matched_blocks) == (pool[1], "precise", 2)
    trust.urls.add(pool[1].url)  # no trusted replica holds it by events: the predicted index routes
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.prefix_source) == (pool[0], "predicted")
    trust.urls.clear()  # its counts agree again: its events route it
    assert scheduler.decide(pool, wanted).replica == pool[2]


def test_blocks_of_another_version_or_salt_never_count_and_the_predicted_index_stays() -> None:
    pool = replicas(2)
    index = PreciseIndex(1000)
    scheduler = Scheduler(index_entries=1000, precise=index)
    index.apply(pool[1].url, [stored(("t@other", "kvg-a"), 4)])  # another version's blocks
    index.apply(pool[1].url, [stored((VERSION.name, "kvg-client"), 4, first_hash=10)])
    wanted = precise_target()
    scheduler.served(wanted, pool[0])
    decision = scheduler.decide(pool, wanted)
    assert (decision.replica, decision.prefix_source, decision.matched_blocks) == (
        pool[0],
        "predicted",
        len(wanted.keys),
    )
    untokenized = Target("t", "base", VERSION, "kvg-a", [])
    assert scheduler.decide(pool, untokenized).prefix_source == "none"


def test_a_precise_holder_over_its_bound_is_passed_over() -> None:
    pool = replicas(2)
    index = PreciseIndex(1000)
    scheduler = Scheduler(index_entries=1000, precise=index)
    index.apply(pool[0].url, [stored((VERSION.name, "kvg-a"), 4)])
    for _ in range(4):
        pool[0].begin("x")
    decision = scheduler.decide(pool, precise_target())
    assert (decision.replica, decision.reason, decision.prefix_source) == (pool[1], "least-loaded", "none")


def test_a_version_quarantined_or_being_unloaded_on_a_replica_is_not_held_there() -> None:
    pool = replicas(3)
    quarantined, unloading, holder = pool
    quarantined.quarantined[VERSION.name] = VERSION.path
    unloading.unloading.add(VERSION.name)
    assert [r.url for r in eligible(pool, target())] == [holder.url]
    holder.quarantined[VERSION.name] = "/another/root"  # quarantined from another root: still held
    assert holds(holder, VERSION.name, VERSION.path)
    decision = Scheduler(index_entries=10).decide([quarantined, unloading], target())
    assert decision.action == "load", "neither holds it: the version is loaded (again)"
