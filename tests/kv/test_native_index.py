"""The KV indexer's C path (``kv._native``: ``parse`` and ``View.apply``) against the Python one
(``kv.events.decode_payload`` and ``PreciseIndex.apply``): the same batches, as vLLM encodes them and
as it might, applied to two indexes with two shared tables give the same views, counts and tables; a batch
the C parser does not take whole is left to Python (``parse`` says None), never half read."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from blake3 import blake3

from gateway.kv import _native
from gateway.kv.events import STORED_FIELDS, decode_message
from gateway.kv.index import Applied, PreciseIndex, table_key
from gateway.kv.shared_index import SharedReader, SharedRegion, SharedWriter, create

REPLICAS = ["http://r0:8000", "http://r1:8000"]
TOKEN_IDS = [0, 5, 127, 128, 65535, 70000, 2**40, 2**63 - 1]  # each msgpack width
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class Side:
    """One index and its own shared table."""

    def __init__(self, capacity: int) -> None:
        self.fd = create(capacity, REPLICAS)
        self.writer = SharedWriter(SharedRegion(self.fd, REPLICAS))
        self.writer.start(1)
        self.index = PreciseIndex(capacity, mirror=self.writer)

    def table(self) -> bytes:
        layout = self.writer.region.layout
        return bytes(self.writer.region.raw[8 * layout.columns_at : layout.size])

    def close(self) -> None:
        self.writer.close()
        os.close(self.fd)


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    native, python = Side(400), Side(400)  # small: the batches below evict
    yield native, python
    native.close()
    python.close()


class Fleet:
    """Batches of one replica's rank: chains that continue known blocks or unknown ones, namespaces of
    every kind vLLM sends (LoRA name, cache salt, both, multimodal keys kvgate cannot key), removals,
    clears; int or bytes hashes; map-encoded (vLLM 0.32) or positional."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.known: list[Any] = []
        self.size = 4

    def hash(self) -> Any:
        rng = self.rng
        value: Any = rng.getrandbits(64) if rng.random() < 0.8 else rng.randbytes(32)
        if isinstance(value, int) and rng.random() < 0.2:
            value = rng.randrange(-(2**63), 0)
        return value

    def extra_keys(self, blocks: int, lora: str | None) -> list[Any] | None:
        rng = self.rng
        shape = rng.choice(["none", "none", "lora", "salt", "both", "multi", "cut"])
        if shape == "none":
            return None
        salt = rng.choice(["s1", "s2"])
        named = [lora] if lora else []
        first: Any = {"lora": named or None, "salt": [salt], "both": [*named, salt],
                      "multi": [salt, "mm", "x"], "cut": named or None}[shape]  # fmt: skip
        rest: list[Any] = [rng.choice([None, [lora] if lora else None]) for _ in range(blocks - 1)]
        if shape == "cut" and blocks > 1:
            rest[rng.randrange(blocks - 1)] = ["image"]
        return [first, *rest]

    def stored(self) -> dict[str, Any]:
        rng = self.rng
        blocks = rng.choice([1, 1, 2, 4, 9])
        parent = None
        if self.known and rng.random() < 0.5:
            parent = rng.choice(self.known) if rng.random() < 0.9 else self.hash()
        lora = rng.choice([None, None, "tenant-42@b3:abc", "tenant-7@b3:def"])
        hashes = [self.hash() for _ in range(blocks)]
        if self.known and rng.random() < 0.1:
            hashes[0] = rng.choice(self.known)  # stored again: moved to the end, its key maybe replaced
        self.known += hashes
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": [rng.choice(TOKEN_IDS) for _ in range(blocks * self.size)],
            "block_size": self.size,
            "lora_id": None if lora is None else 1,
            "medium": rng.choice([None, "GPU", "CPU"]),
            "lora_name": lora,
        }  # fmt: skip
        extra = self.extra_keys(blocks, lora)
        if extra is not None:
            event["extra_keys"] = extra
        if rng.random() < 0.2:
            event["group_idx"] = 0
        return event

    def event(self) -> dict[str, Any]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.02:
            return {"type": "AllBlocksCleared"}
        if roll < 0.2 and self.known:
            picked = [rng.choice(self.known) if rng.random() < 0.8 else self.hash() for _ in range(3)]
            return {"type": "BlockRemoved", "block_hashes": picked, "medium": "GPU"}
        if roll < 0.22:
            self.size = rng.choice([4, 16])
        return self.stored()

    def encode(self, event: dict[str, Any]) -> Any:
        if self.rng.random() < 0.7:
            return {k: v for k, v in event.items() if v is not None or k == "parent_block_hash"}
        kind = event["type"]
        order = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(kind, ())
        values = [event.get(name) for name in order]
        while values and values[-1] is None:
            values.pop()
        return [kind, *values]

    def payload(self) -> bytes:
        events = [self.encode(self.event()) for _ in range(self.rng.randrange(1, 30))]
        ts: Any = 1_700_000_000.5 if self.rng.random() < 0.8 else 1_700_000_000
        batch: list[Any] = [ts, events] + ([0] if self.rng.random() < 0.8 else [])
        return bytes(msgpack.packb(batch))


def test_the_c_path_and_the_python_path_keep_the_same_views_and_tables(sides: tuple[Side, Side]) -> None:
    native, python = sides
    fleet = Fleet(29)
    parsed = 0
    for seq in range(600):
        frames = [b"kv", seq.to_bytes(8, "big"), fleet.payload()]
        fast, slow = decode_message(frames, native=True), decode_message(frames)
        assert fast.native is not None, "every batch here is vLLM's plain case: read in C"
        parsed += 1
        assert slow.native is None
        assert (slow.malformed, slow.unknown) == (0, 0)
        assert (fast.ts, fast.rank, fast.kinds()) == (slow.ts, slow.rank, slow.kinds())
        replica = REPLICAS[seq % 2]
        assert native.index.apply_batch(replica, fast) == python.index.apply_batch(replica, slow)
        assert len(native.index) == len(python.index) <= 400
    for replica in REPLICAS:
        assert native.index.blocks(replica) == python.index.blocks(replica) > 0
        assert native.index.block_size(replica) == python.index.block_size(replica)
        (n_view,), (p_view,) = native.index._views[replica].values(), python.index._views[replica].values()
        assert n_view.items() == p_view.items()
        assert n_view.keys == p_view.keys
    assert native.table() == python.table()
    assert parsed == 600


@pytest.mark.parametrize("size", [4, 600])  # 600: a block hashed in runs of tokens (index.c's TOKEN_RUN)
def test_what_the_c_path_applies_it_keys_as_a_request_is_keyed(sides: tuple[Side, Side], size: int) -> None:
    """A chain stored in C is matched by the request path's keys (``block_keys``), in its namespace only."""
    native, _ = sides
    tokens = [(i * 7919) % 100_000 for i in range(4 * size)]
    event = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
             "token_ids": tokens[: 2 * size], "block_size": size, "lora_name": "t@b3:1",
             "extra_keys": [["t@b3:1", "salt-a"], ["t@b3:1"]]}  # fmt: skip
    more = {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12,
            "token_ids": tokens[2 * size : 3 * size], "block_size": size, "lora_name": "t@b3:1"}  # fmt: skip
    batch = decode_message([b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [event, more], 0])], native=True)
    assert batch.native is not None
    assert native.index.apply_batch(REPLICAS[0], batch) == Applied(stored=3)
    held = native.index.held_blocks(("t@b3:1", "salt-a"), tokens)
    assert held(REPLICAS[0]) == 3
    assert native.index.held_blocks(("t@b3:1", None), tokens)(REPLICAS[0]) == 0
    assert native.index.held_blocks(("t@b3:2", "salt-a"), tokens)(REPLICAS[0]) == 0


PLAIN = [1.5, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                "block_size": 2}], 0]  # fmt: skip


def stored(**fields: Any) -> list[Any]:
    return [1.5, [{**PLAIN[1][0], **fields}], 0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (msgpack.packb(stored(token_ids=[1, -2])), "a negative token id"),
        (msgpack.packb(stored(token_ids=[1, True])), "a bool as a token id"),
        (msgpack.packb(stored(token_ids=[1, 2.0])), "a float as a token id"),
        (msgpack.packb(stored(token_ids=[1, 2**63])), "a token id past int64"),
        (msgpack.packb(stored(token_ids=[1, 2, 3])), "tokens that are not whole blocks"),
        (msgpack.packb(stored(block_size=0)), "a block size of 0"),
        (msgpack.packb(stored(block_hashes=["x"])), "a string as a block hash"),
        (msgpack.packb(stored(parent_block_hash=1.5)), "a float as a parent"),
        (msgpack.packb(stored(lora_name="tenant-é")), "a non-ASCII string (Python checks its UTF-8)"),
        (msgpack.packb(stored(lora_name=7)), "a LoRA name that is not a string"),
        (msgpack.packb(stored(medium=1)), "a medium that is not a string"),
        (msgpack.packb(stored(group_idx="0")), "a group that is not an int"),
        (msgpack.packb(stored(extra_keys=[[1]])), "extra keys other than strings (multimodal)"),
        (msgpack.packb(stored(extra_keys=[None, None])), "extra keys not one per block"),
        (msgpack.packb([1.5, [{"type": "BlockMoved"}], 0]), "an event type of a newer vLLM"),
        (msgpack.packb([1.5, [{"block_hashes": [1]}], 0]), "an event without its type"),
        (msgpack.packb([1.5, [["BlockRemoved", [1], None, 0, None, None, 9]], 0]), "too many fields"),
        (msgpack.packb([1.5, [7], 0]), "an event that is neither map nor array"),
        (msgpack.packb([1.5, [msgpack.ExtType(1, b"x")], 0]), "an ext type"),
        (msgpack.packb({"ts": 1.5, "events": [], "data_parallel_rank": 0}), "a map-encoded batch"),
        (msgpack.packb([True, [], 0]), "a bool as its time"),
        (msgpack.packb([1.5, [], "0"]), "a rank that is not an int"),
        (msgpack.packb(PLAIN) + b"\x00", "bytes after the batch"),
        (msgpack.packb(PLAIN)[:-3], "a cut batch"),
        (b"\x93\x01\x91\x81\xacblock_hashes\xdd\xff\xff\xff\xff", "a count of hashes the bytes cannot hold"),
    ],
)
def test_a_batch_past_the_plain_case_is_left_to_python(payload: bytes, why: str) -> None:
    assert _native.parse(payload) is None, why
    frames = [b"", (0).to_bytes(8, "big"), payload]
    try:
        batch = decode_message(frames, native=True)
    except Exception:  # the Python decoder's MalformedEvent: the whole message refused
        return
    assert batch.native is None


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb(PLAIN),
        msgpack.packb([1, [], None]),
        msgpack.packb([1.5, []]),
        msgpack.packb(PLAIN, use_single_float=True),
        msgpack.packb(
            [1.5, [["BlockStored", [1], None, [1, 2], 2, None, "GPU"], ["AllBlocksCleared", 9]], 3]
        ),
        msgpack.packb(stored(block_hashes=[b"\x01" * 32], kv_cache_spec_kind="full", extra={"a": [1]})),
        msgpack.packb(stored(extra_keys=[["salt"]], lora_name=None)),
    ],
)
def test_vllm_shapes_are_read_in_c_as_python_reads_them(payload: bytes) -> None:
    parsed = _native.parse(payload)
    assert parsed is not None
    batch = decode_message([b"", (0).to_bytes(8, "big"), payload])
    assert (parsed.ts, parsed.rank) == (batch.ts, batch.rank)
    assert {kind: n for kind, n in parsed.counts.items() if n} == batch.kinds()


def test_a_view_keeps_what_a_model_of_it_keeps_and_holds_each_key_in_the_table_once() -> None:
    """``View``'s operations against an ordered dict and a count per key: the same blocks, oldest first,
    the same keys held, and in the shared table exactly the keys some block carries (a small space of
    hashes and keys, so that blocks share keys, move, and are replaced)."""
    side = Side(1000)
    reader_region = SharedRegion(side.fd, REPLICAS)
    try:
        reader = SharedReader(reader_region)
        view = _native.View(side.writer.table, 3)
        rng = random.Random(5)
        keys = [rng.randbytes(16) for _ in range(12)]
        model: dict[int, bytes] = {}
        for step in range(4000):
            roll, block = rng.random(), rng.randrange(40)
            if roll < 0.6:
                key = rng.choice(keys)
                new = view.add(block, key)
                assert new == (block not in model)
                model.pop(block, None)
                model[block] = key
            elif roll < 0.9:
                assert view.remove(block) == (model.pop(block, None) is not None)
            elif roll < 0.99:
                count = rng.randrange(4)
                assert view.pop_oldest(count) == min(count, len(model))
                for old in list(model)[:count]:
                    del model[old]
            else:
                view.empty()
                model.clear()
            if step % 50 == 0 or step > 3950:
                assert view.items() == list(model.items())
                assert (len(view), view.keys) == (len(model), len(set(model.values())))
                for key in keys:
                    assert view.holds(key) == (key in model.values())
                    assert reader.lookup(table_key(key)) == (1 << 3 if key in model.values() else 0)
    finally:
        reader_region.close()
        side.close()


def test_chain_keys_each_block_with_the_key_before_it() -> None:
    """``chain`` (what ``index.block_keys`` keys a request's tokens with) against its definition: key i
    is the first ``len(first)`` bytes of blake3(key i-1 + block i), blocks of any length; ends that fall
    or pass the data are refused."""
    rng = random.Random(7)
    data = rng.randbytes(5000)
    first = rng.randbytes(16)
    ends = sorted(rng.sample(range(5001), 40))
    expected, previous, at = [], first, 0
    for end in ends:
        previous = blake3(previous + data[at:end]).digest(len(first))
        expected.append(previous)
        at = end
    assert _native.chain(first, data, ends) == expected
    assert _native.chain(first, data, []) == []
    assert _native.chain(b"k", data, [3]) == [blake3(b"k" + data[:3]).digest(1)]
    for bad in ([10, 5], [5001], [-1]):
        with pytest.raises(ValueError, match="chain"):
            _native.chain(first, data, bad)
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        _native.chain(b"", data, [1])
