"""vLLM's KV cache events, decoded at the boundary: one ZMQ message at a time, one event at a time. Pure.

A message is three frames, ``[topic, sequence (8 bytes, big-endian), payload]``; the payload is a msgpack
batch ``[ts, events, data_parallel_rank]``. vLLM has encoded events two ways (both accepted, decoded by
field name): positional arrays ``["BlockStored", block_hashes, parent_block_hash, ...]`` in the order of
vLLM's field declarations (trailing defaults omitted), and, since 2026 (vLLM PR 42892, the 0.32 build),
maps tagged by their class ``{"type": "BlockStored", "block_hashes": ..., ...}`` (defaults omitted).

A frame that is not such a message raises ``MalformedEvent``; an event inside a good batch that does not
decode is counted in ``Batch.malformed`` and skipped, never stopping the rest of the batch. Unknown event
types (a newer vLLM) are counted in ``Batch.unknown`` and skipped. Block hashes are opaque: 64-bit ints by
default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), bytes otherwise. Token ids are ints in ``0 .. 2^63 - 1``
(``core.model.all_token_ids``: kvgate keys blocks by their tokens as signed 64-bit ints); an event with any
other is malformed.

The KV indexer reads a batch in C first (``decode_message(native=True)``: ``kv._native.parse``, applied by
``PreciseIndex.apply_batch`` without a Python object per event or token); what C does not take whole, this
module decodes, with the same checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from gateway.core.errors import MalformedEvent
from gateway.core.model import TOKEN_ID_END, all_token_ids
from gateway.kv import _native

BlockHash = int | bytes
ExtraKeys = tuple[object, ...] | None

# vLLM's field order (vllm/distributed/kv_events.py), for the positional encoding.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
SEQUENCE_BYTES = 8
_MAX_PAYLOAD = 64 << 20  # a batch larger than this is not vLLM's


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None  # one entry per block, when vLLM sends them
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class Batch:
    topic: bytes
    seq: int
    ts: float
    events: tuple[Event, ...]
    rank: int | None = None
    malformed: int = 0  # events that did not decode (skipped)
    unknown: int = 0  # events of a type this decoder does not know (skipped)
    errors: tuple[str, ...] = field(default=(), repr=False)  # why, for the first few malformed events
    native: _native.Events | None = field(default=None, repr=False)  # read in C: ``events`` is then empty

    def kinds(self) -> dict[str, int]:
        """How many events of each type it holds."""
        if self.native is not None:
            return {kind: n for kind, n in self.native.counts.items() if n}
        kinds: dict[str, int] = {}
        for event in self.events:
            kind = type(event).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds


def decode_message(frames: Sequence[bytes], *, native: bool = False) -> Batch:
    """One ZMQ message of vLLM's publisher (or of its replay socket) as a batch; raises ``MalformedEvent``.
    ``native``: a batch in the plain case is read in C (``Batch.native``, applied by the index in C,
    the indexer's path), else by ``decode_payload``."""
    if len(frames) != 3:
        raise MalformedEvent(f"a KV event message has 3 frames, got {len(frames)}")
    topic, seq_bytes, payload = (bytes(f) for f in frames)
    seq = sequence(seq_bytes)
    parsed = _native.parse(payload) if native else None
    if parsed is not None:
        return Batch(topic, seq, parsed.ts, (), parsed.rank, native=parsed)
    return decode_payload(topic, seq, payload)


def sequence(seq_bytes: bytes) -> int:
    if len(seq_bytes) != SEQUENCE_BYTES:
        raise MalformedEvent(f"a sequence number is {SEQUENCE_BYTES} bytes, got {len(seq_bytes)}")
    return int.from_bytes(seq_bytes, "big", signed=True)


def peek_ts(payload: bytes) -> float | None:
    """A batch's timestamp, read without decoding its events (the follower's lag check, before the
    cost of a batch is paid); None when the payload does not start as ``[ts, ...]``."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(payload), 1))
    try:
        unpacker.feed(payload)
        if unpacker.read_array_header() < 2:
            return None
        ts = unpacker.unpack()
    except Exception:  # msgpack raises several unrelated types for bad bytes
        return None
    return float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None


def decode_payload(topic: bytes, seq: int, payload: bytes) -> Batch:
    if len(payload) > _MAX_PAYLOAD:
        raise MalformedEvent(f"a KV event batch of {len(payload)} bytes is over {_MAX_PAYLOAD}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise MalformedEvent(f"a KV event batch is not msgpack: {exc}") from exc
    if isinstance(batch, Mapping):  # a map-encoded batch, should vLLM ever send one
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")]
    if not isinstance(batch, list) or not 2 <= len(batch) <= 3:
        raise MalformedEvent("a KV event batch is [ts, events, data_parallel_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(raw_events, list):
        raise MalformedEvent("a KV event batch is [ts, events, data_parallel_rank]")
    if rank is not None and not _is_int(rank):
        raise MalformedEvent("a KV event batch's data_parallel_rank is an int")
    events: list[Event] = []
    malformed = unknown = 0
    errors: list[str] = []
    for raw in raw_events:
        try:
            event = decode_event(raw)
        except MalformedEvent as exc:
            malformed += 1
            if len(errors) < 3:
                errors.append(exc.message)
            continue
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return Batch(topic, seq, float(ts), tuple(events), rank, malformed, unknown, tuple(errors))


def decode_event(raw: object) -> Event | None:
    """One event, tagged map or positional array; None for a type this decoder does not know."""
    if isinstance(raw, Mapping):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        order = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(kind, ())
        if len(raw) - 1 > len(order) and kind in ("BlockStored", "BlockRemoved"):
            raise MalformedEvent(f"{kind} has {len(raw) - 1} fields, at most {len(order)} known")
        fields = dict(zip(order, raw[1:], strict=False))
    else:
        raise MalformedEvent("an event is a tagged map or a tagged array")
    if not isinstance(kind, str):
        raise MalformedEvent("an event's tag is a string")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields), _opt_str(fields, "medium"), _opt_int(fields, "group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: Mapping[str, Any]) -> BlockStored:
    hashes = _hashes(fields)
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise MalformedEvent("BlockStored.parent_block_hash is an int, bytes or None")
    tokens = fields.get("token_ids")
    if not isinstance(tokens, list) or not all_token_ids(tokens):
        raise MalformedEvent(f"BlockStored.token_ids is a list of ints in 0 .. {TOKEN_ID_END - 1}")
    size = fields.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise MalformedEvent("BlockStored.block_size is a positive int")
    if len(tokens) != size * len(hashes):
        raise MalformedEvent(
            f"BlockStored has {len(tokens)} tokens for {len(hashes)} blocks of {size}"
        )  # vLLM publishes full blocks only
    extra = fields.get("extra_keys")
    extra_keys: tuple[ExtraKeys, ...] | None = None
    if extra is not None:
        if not isinstance(extra, list) or len(extra) != len(hashes):
            raise MalformedEvent("BlockStored.extra_keys has one entry per block")
        if not all(entry is None or isinstance(entry, list) for entry in extra):
            raise MalformedEvent("BlockStored.extra_keys entries are arrays or None")
        extra_keys = tuple(None if entry is None else tuple(_frozen(v) for v in entry) for entry in extra)
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        size,
        _opt_str(fields, "lora_name"),
        extra_keys,
        _opt_str(fields, "medium"),
        _opt_int(fields, "group_idx"),
    )


def _hashes(fields: Mapping[str, Any]) -> tuple[BlockHash, ...]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise MalformedEvent("block_hashes is a list of ints or bytes")
    return tuple(hashes)


def _frozen(value: object) -> object:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _opt_str(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise MalformedEvent(f"{name} is a string or None")
    return value


def _opt_int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is not None and not _is_int(value):
        raise MalformedEvent(f"{name} is an int or None")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> bool:
    return _is_int(value) or isinstance(value, bytes)
