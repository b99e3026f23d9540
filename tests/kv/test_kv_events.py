"""vLLM's KV events decoded from frames captured on a real replica, in both encodings, and the precise
index they feed.

The fixtures in tests/support/fixtures/kv_events/: ``map_*.json`` captured from the vLLM 0.32 CPU build
(tagged
maps) started with ``--kv-events-config``; ``array_*.json`` the same payloads re-encoded as positional
arrays by vLLM's own classes (``scripts/kv_event_fixtures.py``).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest

from gateway.core.errors import MalformedEvent
from gateway.kv.events import AllBlocksCleared, Batch, BlockRemoved, BlockStored, decode_message
from gateway.kv.index import PreciseIndex, block_keys, stored_namespace

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "kv_events"
ENCODINGS = ("map", "array")


def messages(name: str) -> list[tuple[str, list[bytes]]]:
    entries = json.loads((FIXTURES / f"{name}.json").read_text())
    return [(e["note"], [base64.b64decode(f) for f in e["frames"]]) for e in entries]


def batches(name: str) -> list[Batch]:
    return [decode_message(frames) for _, frames in messages(name)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_captured_frames_decode_by_field_name(encoding: str) -> None:
    decoded = batches(f"{encoding}_frames")
    assert [b.seq for b in decoded] == [0, 1, 2, 3, 4]
    assert {b.topic for b in decoded} == {b"kv"}
    assert all(b.malformed == 0 and b.unknown == 0 and b.rank == 0 for b in decoded)
    base, salted, lora, chat, after_reset = (b.events for b in decoded)
    for events in (base, salted, lora, chat):
        (event,) = events
        assert isinstance(event, BlockStored)
        assert (len(event.block_hashes), len(event.token_ids), event.block_size) == (3, 384, 128)
        assert event.parent_block_hash is None
        assert event.medium == "GPU"
    assert isinstance(base[0], BlockStored)
    assert isinstance(lora[0], BlockStored)
    assert stored_namespace(base[0]) == (None, None)
    assert isinstance(salted[0], BlockStored)
    assert stored_namespace(salted[0]) == (None, "kvg-0123abcd")
    assert lora[0].lora_name == "t@1"
    assert lora[0].extra_keys == (("t@1", "kvg-abc"), ("t@1",), ("t@1",))
    assert stored_namespace(lora[0]) == ("t@1", "kvg-abc")
    # /reset_prefix_cache: AllBlocksCleared arrives with the next engine step's batch, not before
    assert isinstance(after_reset[0], AllBlocksCleared)
    assert isinstance(after_reset[1], BlockStored)


def test_both_encodings_decode_to_the_same_events() -> None:
    for name in ("frames", "evict_frames"):
        assert [b.events for b in batches(f"map_{name}")] == [b.events for b in batches(f"array_{name}")]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_evictions_decode_as_block_removed(encoding: str) -> None:
    decoded = batches(f"{encoding}_evict_frames")
    removed = [e for b in decoded for e in b.events if isinstance(e, BlockRemoved)]
    assert len(removed) == 5
    assert all(len(e.block_hashes) == 1 and isinstance(e.block_hashes[0], int) for e in removed)


def _frames(events: list[object], seq: int = 7) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgpack.packb([1.5, events, 0])]


GOOD = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 4},  # tokens short
        {"type": "BlockStored", "block_hashes": ["x"], "token_ids": [1], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1, "extra_keys": [1]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1, "lora_name": 3},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1 << 63], "block_size": 1},  # over int64
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [(1 << 64) - 1], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [-1], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [3, True], "block_size": 1},  # a bool
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1.0], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": ["1"], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [None], "block_size": 1},
        ["BlockStored", [1], None, [1 << 63], 1],
        {"type": "BlockRemoved", "block_hashes": None},
        {"type": 3},
        ["BlockRemoved", [1], "GPU", 0, None, None, "one too many"],
        "BlockStored",
        [],
    ],
)
def test_a_malformed_event_is_counted_and_skipped(bad: object) -> None:
    batch = decode_message(_frames([GOOD, bad, GOOD]))
    assert batch.events == (BlockRemoved((5,), "GPU"), BlockRemoved((5,), "GPU"))
    assert (batch.malformed, batch.unknown) == (1, 0)


def test_an_unknown_event_type_is_counted_apart() -> None:
    batch = decode_message(_frames([{"type": "BlockMoved", "block_hashes": [1]}, ["Future", 1], GOOD]))
    assert (batch.events, batch.malformed, batch.unknown) == ((BlockRemoved((5,), "GPU"),), 0, 2)


@pytest.mark.parametrize(
    "frames",
    [
        [b"kv", (1).to_bytes(8, "big")],
        [b"kv", b"\x00\x01", msgpack.packb([1.0, [], 0])],
        [b"kv", (1).to_bytes(8, "big"), b"\xc1"],
        [b"kv", (1).to_bytes(8, "big"), msgpack.packb({"a": 1})],
        [b"kv", (1).to_bytes(8, "big"), msgpack.packb(["ts", [], 0])],
        [b"kv", (1).to_bytes(8, "big"), msgpack.packb([1.0, {}, 0])],
        [b"kv", (1).to_bytes(8, "big"), msgpack.packb([1.0, [], "rank"])],
    ],
)
def test_a_malformed_message_raises_the_boundary_error(frames: list[bytes]) -> None:
    with pytest.raises(MalformedEvent):
        decode_message(frames)


# --- the precise index -----------------------------------------------------------------------------


def _stored(
    lora: str | None, salt: str | None, tokens: list[int], hashes: list[int], parent: int | None = None
) -> BlockStored:
    first: tuple[object, ...] | None = tuple(x for x in (lora, salt) if x is not None) or None
    rest: tuple[object, ...] | None = (lora,) if lora else None
    extra = (first if parent is None else rest, *([rest] * (len(hashes) - 1)))
    return BlockStored(tuple(hashes), parent, tuple(tokens), 4, lora, extra)


TOKENS = list(range(100, 112))  # three blocks of 4


def test_captured_blocks_match_requests_keyed_from_their_tokens() -> None:
    index = PreciseIndex(1000)
    for batch in batches("map_frames")[:3]:
        index.apply("r1", batch.events)
    lora = batches("map_frames")[2].events[0]
    assert isinstance(lora, BlockStored)
    tokens = [*list(lora.token_ids), 1, 2, 3]
    assert index.matched(block_keys(("t@1", "kvg-abc"), tokens, 128), "r1") == 3
    assert index.matched(block_keys(("t@1", "kvg-abc"), tokens, 128), "r2") == 0
    assert index.matched(block_keys(("t@2", "kvg-abc"), tokens, 128), "r1") == 0  # another version
    assert index.matched(block_keys(("t@1", "kvg-other"), tokens, 128), "r1") == 0  # another salt
    assert index.matched(block_keys((None, "kvg-0123abcd"), tokens, 128), "r1") == 3
    assert index.matched(block_keys((None, None), tokens, 128), "r1") == 3
    assert len(index) == 9
    assert index.block_size("r1") == 128


def test_blocks_of_one_version_never_count_for_another() -> None:
    index = PreciseIndex(100)
    index.apply("r1", [_stored("t@v1", "kvg-1", TOKENS, [1, 2, 3])])
    assert index.matched(block_keys(("t@v1", "kvg-1"), TOKENS, 4), "r1") == 3
    assert index.matched(block_keys(("t@v2", "kvg-1"), TOKENS, 4), "r1") == 0
    assert index.matched(block_keys(("t@v2", "kvg-2"), TOKENS, 4), "r1") == 0


def test_a_continued_chain_is_keyed_from_its_parent() -> None:
    index = PreciseIndex(100)
    index.apply("r1", [_stored("t@v1", "kvg-1", TOKENS[:4], [1])])
    index.apply("r1", [_stored("t@v1", "kvg-1", TOKENS[4:], [2, 3], parent=1)])
    assert index.matched(block_keys(("t@v1", "kvg-1"), TOKENS, 4), "r1") == 3
    orphan = index.apply("r1", [_stored("t@v1", "kvg-1", TOKENS[4:], [8, 9], parent=77)])
    assert (orphan.stored, orphan.skipped) == (0, 2)


def test_block_removed_and_all_blocks_cleared_empty_what_they_name() -> None:
    index = PreciseIndex(100)
    index.apply("r1", [_stored(None, "kvg-1", TOKENS, [1, 2, 3])])
    index.apply("r2", [_stored(None, "kvg-1", TOKENS, [7, 8, 9])])
    keys = block_keys((None, "kvg-1"), TOKENS, 4)
    index.apply("r1", [BlockRemoved((2,))])
    assert (index.matched(keys, "r1"), index.matched(keys, "r2"), len(index)) == (1, 3, 5)
    index.apply("r2", [AllBlocksCleared()])
    assert (index.matched(keys, "r2"), len(index)) == (0, 2)
    index.clear("r1")
    assert (index.matched(keys, "r1"), len(index)) == (0, 0)


def test_unkeyable_extra_keys_count_for_nobody() -> None:
    index = PreciseIndex(100)
    mm = BlockStored((1, 2), None, tuple(TOKENS[:8]), 4, None, (("kvg-1", ("mm-hash", 0)), None))
    assert index.apply("r1", [mm]).skipped == 2
    assert len(index) == 0


def test_the_budget_drops_the_largest_view_oldest_first() -> None:
    index = PreciseIndex(4)
    index.apply("r1", [_stored(None, "kvg-1", TOKENS, [1, 2, 3])])
    index.apply("r2", [_stored(None, "kvg-2", TOKENS[:8], [4, 5])])
    assert len(index) == 4
    assert (index.blocks("r1"), index.blocks("r2")) == (2, 2)
    assert index.matched(block_keys((None, "kvg-1"), TOKENS, 4), "r1") == 0  # its first block went
