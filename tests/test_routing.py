"""Prefix block keys, the prefix index and the routing choice, on plain objects."""

from __future__ import annotations

from gateway.backends import AdapterListing
from gateway.prefix import BLOCK_CHARS, PrefixIndex, block_keys, prompt_text
from gateway.replicas import Replica
from gateway.routing import choose, within_bound

TEXT = "".join(f"sentence {i} of a long shared system prompt. " for i in range(60))


def replicas(count: int) -> list[Replica]:
    made = [Replica(f"http://r{i}") for i in range(count)]
    for replica in made:
        replica.healthy = True
        replica.listing = AdapterListing("base", "/m", {})
    return made


def test_keys_chain_over_full_blocks_and_depend_on_the_namespace() -> None:
    keys = block_keys("kvg-a", TEXT)
    assert len(keys) == len(TEXT) // BLOCK_CHARS
    assert block_keys("kvg-a", TEXT + " and a new question")[: len(keys)] == keys
    assert not set(block_keys("kvg-b", TEXT)) & set(keys), "another namespace never matches"
    assert prompt_text({"messages": [{"role": "user", "content": "x"}]}) == '[{"content":"x","role":"user"}]'


def test_index_matches_leading_blocks_and_forgets_least_recent() -> None:
    keys = block_keys("kvg-a", TEXT)
    index = PrefixIndex(capacity=len(keys))
    index.record(keys[:3], "http://r0")
    assert index.matched(keys, "http://r0") == 3
    assert index.matched(keys, "http://r1") == 0
    index.record(block_keys("kvg-b", TEXT), "http://r1")  # pushes the older entries out
    assert index.matched(keys, "http://r0") == 0


def test_longest_prefix_wins_and_ties_are_stable() -> None:
    pool = replicas(3)
    keys = block_keys("kvg-a", TEXT)
    index = PrefixIndex(1000)
    index.record(keys[:2], pool[0].url)
    index.record(keys, pool[2].url)
    choice = choose(pool, keys, index)
    assert (choice.replica, choice.decision, choice.matched_blocks) == (pool[2], "prefix", len(keys))

    for replica in pool:
        index.record(keys, replica.url)
    picks = {choose(pool, keys, index).replica.url for _ in range(5)}
    assert len(picks) == 1, "a prefix held everywhere keeps going to one replica (rendezvous)"


def test_bounded_load_skips_an_overloaded_holder() -> None:
    pool = replicas(2)
    keys = block_keys("kvg-a", TEXT)
    index = PrefixIndex(1000)
    index.record(keys, pool[0].url)
    for _ in range(4):
        pool[0].begin("x")
    assert within_bound(pool) == [pool[1]]
    choice = choose(pool, keys, index)
    assert (choice.replica, choice.decision) == (pool[1], "least-loaded")
