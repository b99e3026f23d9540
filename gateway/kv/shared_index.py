"""The precise index as every worker of one kvgate reads it: a table in shared memory, written by the KV
indexer process alone (``kv.indexer``), read by the workers with no system call and no lock.

One anonymous memory file (``memfd``), made by the process that starts the indexer (the workers' parent,
or a one-process kvgate) and inherited by the indexer and every worker, mapped by each. All of it is
little-endian 64-bit words:

- a header: magic, layout, the table's size, mask words per slot, replicas, columns, the **seqlock**
  counter, a digest of the replica list (both sides must mean the same replica by the same number), the
  writer's pid and heartbeat, the generation (a new indexer starts from an empty table), entries;
- one record per replica (in the settings' order): its events' state (``follower.STATES`` plus
  ``lagging``), lag, blocks, the last batch's time, batches dropped, the purges and restarts workers
  saw (each a count any worker moves: the indexer empties the view when it moves), and the
  follower's ``health()`` as JSON (what ``/healthz`` shows of it);
- one record per column: the (replica, data-parallel rank) it stands for and that rank's block size;
- the table: open addressing with linear probing, ``capacity`` slots of a 64-bit block key (the first 8
  bytes of ``index.block_keys``' key; 0 is an empty slot) and a bitmask of the columns holding it.
  Deletion shifts the entries after it back (no tombstones: probes stay short).

Consistency: the writer makes every change between two increments of the seqlock counter (odd while it
writes); a reader takes a slot's key and mask, then checks that the counter is even and unchanged, else
reads that key again, at most ``READ_TRIES`` times, then counts it as held nowhere. A key read this way
was held at one moment during the read; a request's leading-block count is built from such keys. This
leans on x86-64's ordering of loads and stores (TSO); a weaker memory model needs fences in the writer.
Nothing here claims more than the indexer's views hold: a slot's bit is set only while that column's
view holds the key, and an entry read mid-change is read again or counted as not held.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson
from blake3 import blake3

from gateway.core.errors import KvgateError
from gateway.kv._native import Table
from gateway.kv.follower import ROUTING, STATES
from gateway.kv.index import Namespace, block_keys, table_key

MAGIC = 0x31305F7865646E69  # "index_01"
LAYOUT = 1
HEADER_WORDS = 16
RECORD_WORDS = 128  # a replica's record: 8 words of figures, then its health as JSON (960 bytes)
REASON_BYTES = (RECORD_WORDS - 8) * 8
_SHORT = 200  # a health document too long for its record has its strings cut to this
READ_TRIES = 8
MIN_SLOTS = 1024

# header word offsets
_MAGIC, _LAYOUT, _CAPACITY, _WORDS, _REPLICAS, _COLUMNS, _SEQ, _DIGEST = range(8)
_PID, _HEARTBEAT, _GENERATION, _ENTRIES, _COLUMNS_VERSION, _OWNER, _TOKEN = range(8, 15)
# record word offsets
STATE, LAG_MS, BLOCKS, LAST_BATCH_MS, DROPPED, PURGES, REASON_LEN, RESTARTS = range(8)

STATE_CODES = ("unavailable", "following", "partial", "lost", "lagging")  # follower.STATES, as numbers
ROUTABLE = frozenset(state for state, trust in ROUTING.items() if trust != "predicted")


def replicas_digest(replicas: Sequence[str]) -> int:
    return int.from_bytes(blake3("\n".join(replicas).encode()).digest(8), "little") or 1


@dataclass(frozen=True, slots=True)
class Layout:
    """Where everything is in the shared file, from its size parameters."""

    capacity: int  # table slots, a power of two
    words: int  # 64-bit mask words per slot
    replicas: int

    @classmethod
    def sized(cls, entries: int, replicas: int) -> Layout:
        """Room for ``entries`` blocks at a load of at most one half, and two columns per replica
        (data-parallel ranks; a replica's further ranks share what is left)."""
        capacity = MIN_SLOTS
        while capacity < 2 * entries:
            capacity *= 2
        return cls(capacity, max(1, -(-2 * replicas // 64)), replicas)

    @property
    def columns(self) -> int:
        return 64 * self.words

    @property
    def records_at(self) -> int:
        return HEADER_WORDS

    @property
    def columns_at(self) -> int:
        return self.records_at + self.replicas * RECORD_WORDS

    @property
    def keys_at(self) -> int:
        return self.columns_at + 2 * self.columns

    @property
    def masks_at(self) -> int:
        return self.keys_at + self.capacity

    @property
    def size(self) -> int:
        return 8 * (self.masks_at + self.capacity * self.words)


def create(entries: int, replicas: Sequence[str]) -> int:
    """A new shared file for ``entries`` blocks of ``replicas``: its descriptor (inheritable: pass it to
    the indexer and the workers), header written, table empty."""
    layout = Layout.sized(entries, len(replicas))
    fd = os.memfd_create("kvgate-kv-index", 0)
    os.ftruncate(fd, layout.size)
    os.set_inheritable(fd, True)
    with mmap.mmap(fd, layout.size) as region:
        words = memoryview(region).cast("Q")
        header = (MAGIC, LAYOUT, layout.capacity, layout.words, layout.replicas, layout.columns, 0,
                  replicas_digest(replicas))  # fmt: skip
        for i, value in enumerate(header):
            words[i] = value
        words[_OWNER] = os.getpid()
        words[_TOKEN] = secrets.randbits(48)
        words.release()
    return fd


class SharedRegion:
    """The shared file mapped, its layout read back and checked against ``replicas``."""

    def __init__(self, fd: int, replicas: Sequence[str]) -> None:
        size = os.fstat(fd).st_size
        if size < 8 * HEADER_WORDS:
            raise KvgateError(f"the shared KV index is {size} bytes: not one")
        self.map = mmap.mmap(fd, size)
        self.words = memoryview(self.map).cast("Q")
        self.raw = memoryview(self.map)
        w = self.words
        if w[_MAGIC] != MAGIC or w[_LAYOUT] != LAYOUT:
            raise KvgateError("the shared KV index is of another layout")
        if w[_DIGEST] != replicas_digest(replicas):
            raise KvgateError("the shared KV index was made for another list of replicas")
        self.layout = Layout(w[_CAPACITY], w[_WORDS], w[_REPLICAS])
        if self.layout.size > size:
            raise KvgateError("the shared KV index is shorter than its layout")
        self.replicas = list(replicas)
        self.number = {url: i for i, url in enumerate(replicas)}

    @property
    def tag(self) -> str:
        """What names this file among others (its maker's pid and a random token): the indexer's page."""
        return f"{self.words[_OWNER]}-{self.words[_TOKEN]:012x}"

    def record(self, replica: int) -> int:
        return self.layout.records_at + replica * RECORD_WORDS

    def close(self) -> None:
        self.words.release()
        self.raw.release()
        self.map.close()


def region_tag(fd: int, replicas: Sequence[str]) -> str:
    """The shared file's tag (``SharedRegion.tag``), for a process that does not keep it mapped."""
    region = SharedRegion(fd, replicas)
    try:
        return region.tag
    finally:
        region.close()


class SharedWriter:
    """The indexer's side: the table's keys and masks (``kv._native.Table``, in C: the views hold and
    release keys there), the replicas' records and the columns. One writer (the indexer process); every
    change inside the seqlock. ``close`` before the region's."""

    def __init__(self, region: SharedRegion) -> None:
        self.region = region
        self.w = region.words
        layout = region.layout
        self.table = Table(region.map, layout.capacity, layout.words, layout.keys_at, layout.masks_at, _SEQ,
                           _ENTRIES)  # fmt: skip
        self.columns: dict[tuple[int, int], int] = {}

    def start(self, generation: int) -> None:
        """A new indexer: the table and columns emptied (its views start empty), its pid and generation."""
        w, layout = self.w, self.region.layout
        self._begin()
        self.region.raw[8 * layout.columns_at : layout.size] = bytes(layout.size - 8 * layout.columns_at)
        for replica in range(layout.replicas):
            for i in range(STATE, PURGES):
                w[self.region.record(replica) + i] = 0
        w[_ENTRIES] = 0
        w[_PID], w[_GENERATION] = os.getpid(), generation
        w[_COLUMNS_VERSION] += 1
        self._end()

    def _begin(self) -> None:
        self.w[_SEQ] += 1

    def _end(self) -> None:
        self.w[_SEQ] += 1

    def column(self, replica: str, rank: int) -> int | None:
        """The column of one rank's view of ``replica`` (taken on first use); None when every column is
        taken (that rank is not shared: its replica shows ``partial``)."""
        number = self.region.number.get(replica)
        if number is None:
            return None
        found = self.columns.get((number, rank))
        if found is not None:
            return found
        free = len(self.columns)
        if free >= self.region.layout.columns:
            return None
        at = self.region.layout.columns_at + 2 * free
        self._begin()
        self.w[at], self.w[at + 1] = number + 1, rank
        self.w[_COLUMNS_VERSION] += 1
        self._end()
        self.columns[(number, rank)] = free
        return free

    def block_size(self, column: int, size: int) -> None:
        at = self.region.layout.columns_at + 2 * column + 1
        value = (self.w[at] & 0xFFFFFFFF) | (size << 32)
        if self.w[at] != value:
            self._begin()
            self.w[at] = value
            self.w[_COLUMNS_VERSION] += 1
            self._end()

    def hold(self, key: int, column: int) -> None:
        """``column``'s view holds ``key`` (its first block carrying it)."""
        self.table.hold(key, column)

    def release(self, key: int, column: int) -> None:
        """``column``'s view no longer holds ``key``: its bit cleared, the entry deleted when no column
        holds it (the entries after it in its probe run shifted back)."""
        self.table.release(key, column)

    def report(self, replica: str, state: str, health: dict[str, object], lag_s: float | None, blocks: int,
               last_batch: float | None, dropped: int) -> None:  # fmt: skip
        """One replica's figures for the workers (routing trust, ``/healthz``), and its follower's
        ``health()`` (strings cut short when it would not fit)."""
        number = self.region.number.get(replica)
        if number is None:
            return
        at = self.region.record(number)
        w = self.w
        text = orjson.dumps(health)
        if len(text) > REASON_BYTES:
            short = {k: v[:_SHORT] if isinstance(v, str) else v for k, v in health.items()}
            text = orjson.dumps(short)
        if len(text) > REASON_BYTES:
            text = orjson.dumps({"state": state})
        self._begin()
        w[at + STATE] = STATE_CODES.index(state)
        w[at + LAG_MS] = 0 if lag_s is None else max(0, int(lag_s * 1000)) + 1
        w[at + BLOCKS] = blocks
        w[at + LAST_BATCH_MS] = 0 if last_batch is None else int(last_batch * 1000)
        w[at + DROPPED] = dropped
        w[at + REASON_LEN] = len(text)
        start = 8 * (at + 8)
        self.region.raw[start : start + len(text)] = text
        self._end()

    def purges(self, replica: str) -> int:
        """How many purges workers asked of ``replica``'s view (``SharedReader.purged``)."""
        return self._count(replica, PURGES)

    def restarts(self, replica: str) -> int:
        """How many restarts of ``replica`` workers saw (``SharedReader.restarted``)."""
        return self._count(replica, RESTARTS)

    def _count(self, replica: str, word: int) -> int:
        number = self.region.number.get(replica)
        return 0 if number is None else int(self.w[self.region.record(number) + word])

    def beat(self, now_ms: int) -> None:
        self.w[_HEARTBEAT] = now_ms

    def close(self) -> None:
        """Let go of the table (the region's mapping can then close) and the region."""
        self.table.close()
        self.region.close()


@dataclass(frozen=True, slots=True)
class ReplicaEvents:
    """One replica's events as the indexer last reported them."""

    state: str
    health: dict[str, object]  # the follower's ``health()``, as last reported (``settled`` taken out)
    lag_s: float | None
    blocks: int
    last_batch: float | None  # unix time of the last batch applied
    dropped: int
    settled: bool = False  # its state will not move by itself soon (``KvFollower.settled``)


class SharedReader:
    """A worker's side: ``held_blocks`` (the scheduler's ``HeldBlocks``) and the replicas' figures."""

    def __init__(self, region: SharedRegion) -> None:
        self.region = region
        self.w = region.words
        layout = region.layout
        self.mask, self.width = layout.capacity - 1, layout.words
        self.keys_at, self.masks_at = layout.keys_at, layout.masks_at
        self.gave_up = 0  # keys read mid-change READ_TRIES times: counted as held nowhere
        self._columns_version = -1
        self._columns: dict[int, list[tuple[int, int]]] = {}  # replica number -> (column, block size)

    def lookup(self, key: int) -> int:
        """The columns holding ``key`` (a bitmask), read consistently; 0 when it is held nowhere."""
        w, mask, width, keys_at = self.w, self.mask, self.width, self.keys_at
        for _ in range(READ_TRIES):
            seq = w[_SEQ]
            if seq & 1:
                continue
            i = key & mask
            found = w[keys_at + i]
            while found != key and found != 0:
                i = (i + 1) & mask
                found = w[keys_at + i]
            held = 0
            if found:
                at = self.masks_at + i * width
                for k in range(width):
                    held |= w[at + k] << (64 * k)
            if w[_SEQ] == seq:
                return held
        self.gave_up += 1
        return 0

    def columns(self) -> dict[int, list[tuple[int, int]]]:
        """Each replica's columns with their block size, re-read when the indexer changed them."""
        w = self.w
        for _ in range(READ_TRIES):
            seq, version = w[_SEQ], w[_COLUMNS_VERSION]
            if version == self._columns_version:
                return self._columns
            if seq & 1:
                continue
            found: dict[int, list[tuple[int, int]]] = {}
            at = self.region.layout.columns_at
            for column in range(self.region.layout.columns):
                replica = w[at + 2 * column]
                if replica == 0:
                    break
                found.setdefault(replica - 1, []).append((column, w[at + 2 * column + 1] >> 32))
            if w[_SEQ] == seq:
                self._columns, self._columns_version = found, version
                return found
        return {}

    def state(self, replica: str) -> str:
        """``replica``'s events' state alone: one word, read as it is (the request path's trust check)."""
        number = self.region.number.get(replica)
        code = self.w[self.region.record(number) + STATE] if number is not None else 0
        return STATE_CODES[code] if code < len(STATE_CODES) else "unavailable"

    def events(self, replica: str) -> ReplicaEvents:
        """``replica``'s record (an unknown URL: unavailable)."""
        number = self.region.number.get(replica)
        if number is None:
            return ReplicaEvents("unavailable", {"reason": "not a configured replica"}, None, 0, None, 0)
        at = self.region.record(number)
        w = self.w
        for _ in range(READ_TRIES):
            seq = w[_SEQ]
            if seq & 1:
                continue
            fields = (STATE, LAG_MS, BLOCKS, LAST_BATCH_MS, DROPPED, REASON_LEN)
            code, lag, blocks, last, dropped, length = (w[at + i] for i in fields)
            start = 8 * (at + 8)
            reason = bytes(self.region.raw[start : start + min(length, REASON_BYTES)])
            if w[_SEQ] == seq:
                state = STATE_CODES[code] if code < len(STATE_CODES) else "unavailable"
                health = _health(reason)
                return ReplicaEvents(
                    state,
                    health,
                    None if lag == 0 else (lag - 1) / 1000,
                    blocks,
                    None if last == 0 else last / 1000,
                    dropped,
                    health.pop("settled", False) is True,
                )
        return ReplicaEvents("unavailable", {"reason": "its record is being written"}, None, 0, None, 0)

    def block_size(self, replica: str) -> int | None:
        """``replica``'s KV block size by its events (the first of its ranks' that has one; None before
        its first batch): a precise claim in tokens (``kv.live_check``)."""
        number = self.region.number.get(replica)
        sizes = [size for _, size in self.columns().get(number, [])] if number is not None else []
        return next((size for size in sizes if size), None)

    def purged(self, replica: str) -> None:
        """Ask the indexer to empty ``replica``'s view (kvgate purged its cache). Any worker may ask;
        the indexer acts on any change of the count."""
        self._bump(replica, PURGES)

    def restarted(self, replica: str) -> None:
        """Tell the indexer ``replica`` restarted (a worker's poll saw it): its view is emptied, as
        vLLM's events of the engine that is gone no longer hold."""
        self._bump(replica, RESTARTS)

    def _bump(self, replica: str, word: int) -> None:
        number = self.region.number.get(replica)
        if number is not None:
            self.w[self.region.record(number) + word] += 1

    def owner(self) -> int:
        """The pid of the process that made the file (and keeps the indexer)."""
        return int(self.w[_OWNER])

    def writer(self) -> tuple[int, int, int]:
        """The indexer's pid, last heartbeat (unix ms) and generation."""
        return self.w[_PID], self.w[_HEARTBEAT], self.w[_GENERATION]

    def held_blocks(self, namespace: Namespace, tokens: Sequence[int]) -> Callable[[str], int]:
        """For one request, how many leading blocks of ``tokens`` each replica holds by its events (the
        most any one of its ranks holds), 0 for a replica whose events are not routable (``ROUTABLE``:
        lost, lagging, unavailable), so the predicted index routes it."""
        columns = self.columns()
        held_by_size: dict[int, list[int]] = {}

        def masks(size: int) -> list[int]:
            found = held_by_size.get(size)
            if found is None:
                found = held_by_size[size] = []
                for key in block_keys(namespace, tokens, size):
                    held = self.lookup(table_key(key))
                    if not held:
                        break
                    found.append(held)
            return found

        def held(replica: str) -> int:
            number = self.region.number.get(replica)
            if number is None or number not in columns:
                return 0
            if self.state(replica) not in ROUTABLE:
                return 0
            best = 0
            for column, size in columns[number]:
                if not size:
                    continue
                bit, count = 1 << column, 0
                for mask in masks(size):
                    if not mask & bit:
                        break
                    count += 1
                best = max(best, count)
            return best

        return held


def _health(text: bytes) -> dict[str, object]:
    """A record's health document, parsed at the boundary (the indexer wrote it, but a torn or empty
    one is shown as such, never trusted)."""
    try:
        doc = orjson.loads(text) if text else {}
    except orjson.JSONDecodeError:
        return {"reason": "its health record does not parse"}
    return doc if isinstance(doc, dict) else {"reason": "its health record is not an object"}


def events_health(reader: SharedReader, names: dict[str, str]) -> tuple[dict[str, int], dict[str, object]]:
    """``/healthz``'s ``kv_events``: how many replicas are in each state (public), and each replica's
    record under its public name (``names``; detail): its state and the routing trust it gives
    (``follower.ROUTING``), why, its lag, the age of its last batch, its blocks, batches dropped."""
    counts = {"streams": len(reader.region.replicas), **dict.fromkeys(STATES, 0)}
    detail: dict[str, object] = {}
    now = time.time()
    for url in reader.region.replicas:
        events = reader.events(url)
        counts[events.state] += 1
        detail[names.get(url, url)] = {
            **events.health,
            "state": events.state,
            "routing": ROUTING[events.state],
            "lag_s": events.lag_s,
            "last_batch_s_ago": None if events.last_batch is None else round(now - events.last_batch, 1),
            "blocks": events.blocks,
            "dropped_batches": events.dropped,
        }
    return counts, detail


def indexer_health(reader: SharedReader) -> dict[str, object]:
    """``/healthz``'s ``kv_indexer``: the indexer's pid, generation (restarts + 1) and the age of its
    heartbeat (a stalled indexer shows here; its replicas' lag shows in ``kv_events``)."""
    pid, beat, generation = reader.writer()
    since = None if not beat else round(time.time() - beat / 1000, 1)
    return {"pid": pid, "generation": generation, "heartbeat_s_ago": since}
