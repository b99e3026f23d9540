"""The precise prefix index: which replica holds which token blocks, learned from vLLM's KV events. Pure.

Blocks are keyed like the cache keys them, but by kvgate: chained blake3 keys over each block's token ids,
seeded by the namespace the block was computed in, ``(lora_name, cache_salt)`` (``block_keys``). vLLM's
own block hashes come from a per-process seed and are never reproduced here; each replica's view maps
vLLM's hash to kvgate's key, which is how ``BlockRemoved`` finds what to drop. A request is keyed the same
way from its tokens, its versioned adapter name and the salt kvgate gives it, so:

- blocks of one version never count for another (the versioned name is in the seed);
- blocks of a salt kvgate did not give (a client's own traffic straight to a replica) count for nobody:
  no request kvgate keys has that salt;
- blocks kvgate cannot key from tokens alone (multimodal or prompt-embedding extra keys) are skipped.

Each replica has its own view (one per data-parallel rank, each fed by that rank's events), emptied on
its restart, a purge kvgate made (``clear``), and per rank on an ``AllBlocksCleared``, an event gap or a
lost stream. The index holds at most ``capacity`` blocks over all views; past that the
largest view loses its oldest blocks first (``loadtest/precise_index_memory.py`` measures the bytes).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from blake3 import blake3

from gateway.kv._native import Table, View, chain
from gateway.kv.events import AllBlocksCleared, Batch, BlockRemoved, BlockStored, Event

KEY_BYTES = 16
MAX_BLOCKS = 2048  # bounds the hashing work per request (256K tokens at vLLM's CPU block size)
_SEED = b"kvgate-precise\0"

Namespace = tuple[str | None, str | None]  # (lora_name, cache_salt); (None, None): the base, unsalted


def seed(namespace: Namespace) -> bytes:
    name, salt = namespace
    parts = (
        (b"-" if name is None else b"n" + name.encode())
        + b"\0"
        + (b"-" if salt is None else b"s" + salt.encode())
    )
    return blake3(_SEED + parts).digest(KEY_BYTES)


def block_keys(
    namespace: Namespace, tokens: Sequence[int], block_size: int, *, parent: bytes | None = None
) -> list[bytes]:
    """Chained keys of every full block of ``tokens``: key[i] depends on the namespace and blocks 0..i
    (or on ``parent``, the key of the block before the first, for a chain that continues one)."""
    count = min(len(tokens) // block_size, MAX_BLOCKS)
    data = array("q", tokens[: count * block_size]).tobytes()  # each block's ids as int64 LE
    step = 8 * block_size
    return chain(seed(namespace) if parent is None else parent, data, range(step, count * step + 1, step))


def table_key(key: bytes) -> int:
    """The shared table's 64-bit key of one of ``block_keys``' keys (never 0: 0 is an empty slot)."""
    return int.from_bytes(key[:8], "little") or 1


class Mirror(Protocol):
    """Where the index copies which view holds which key (``kv.shared_index.SharedWriter``: the table
    every worker reads). A view's column is taken on first use; None: that view is not mirrored."""

    @property
    def table(self) -> Table: ...
    def column(self, replica: str, rank: int) -> int | None: ...
    def block_size(self, column: int, size: int) -> None: ...


def stored_namespace(event: BlockStored) -> Namespace | None:
    """The namespace of a chain's first block: its ``lora_name`` and the salt in its extra keys (the
    entry holds the LoRA name first when there is one, then the salt). None when the entry holds
    something else too (multimodal or prompt-embedding keys: not keyable from tokens)."""
    entry = event.extra_keys[0] if event.extra_keys else None
    rest = list(entry or ())
    if event.lora_name is not None and rest and rest[0] == event.lora_name:
        rest.pop(0)
    if not rest:
        return (event.lora_name, None)
    if len(rest) == 1 and isinstance(rest[0], str):
        return (event.lora_name, rest[0])
    return None


def _keyable_blocks(event: BlockStored) -> int:
    """How many of the event's blocks are keyed by tokens alone: extra keys past the first block may
    hold the LoRA name and nothing else."""
    if not event.extra_keys:
        return len(event.block_hashes)
    for i, entry in enumerate(event.extra_keys[1:], start=1):
        if entry and (len(entry) > 1 or entry[0] != event.lora_name):
            return i
    return len(event.block_hashes)


@dataclass(slots=True)
class Applied:
    """What one batch did to a view."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    skipped: int = 0  # blocks not keyed: unknown parent, extra keys kvgate cannot reproduce


class PreciseIndex:
    """Per-replica views of the blocks each replica holds, bounded to ``capacity`` blocks in all.

    A replica's view is one view per data-parallel rank (each rank is an engine with its own cache and
    its own event stream): the replica holds a prefix when one of its ranks holds all of it, its blocks
    are those of all its ranks, and one rank's view can be emptied alone (its stream was lost) without
    claiming or dropping what the other ranks hold.

    A view is ``kv._native.View`` (C): vLLM's hash -> kvgate's key, oldest first, and how many of vLLM's
    blocks carry each key, the first of which holds it in the mirror's table. A batch the native parser
    read (``Batch.native``) is applied in C, every block of it; one it left to ``kv.events`` (anything but
    the plain case) is applied here, an event at a time, with the same result."""

    def __init__(self, capacity: int, mirror: Mirror | None = None) -> None:
        self.capacity = capacity
        self.mirror = mirror
        self._views: dict[str, dict[int, View]] = {}  # replica -> data-parallel rank -> its view
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def blocks(self, replica: str, rank: int | None = None) -> int:
        """The blocks a replica's view holds (of every rank, or of ``rank``)."""
        views = self._views.get(replica, {})
        return sum(len(v) for r, v in views.items() if rank is None or r == rank)

    def block_size(self, replica: str) -> int | None:
        sizes = [v.block_size for v in self._views.get(replica, {}).values() if v.block_size is not None]
        return sizes[0] if sizes else None

    def block_sizes(self) -> set[int]:
        return {
            v.block_size for views in self._views.values() for v in views.values() if v.block_size is not None
        }

    def matched(self, keys: Sequence[bytes], replica: str) -> int:
        """How many leading blocks of ``keys`` the replica holds (by its events): the most any of its
        ranks holds."""
        best = 0
        for view in self._views.get(replica, {}).values():
            count = 0
            for key in keys:
                if not view.holds(key):
                    break
                count += 1
            best = max(best, count)
        return best

    def held_blocks(self, namespace: Namespace, tokens: Sequence[int]) -> Callable[[str], int]:
        """For one request, how many leading blocks of ``tokens`` (keyed in ``namespace``, the one its
        blocks will have) each replica holds by its events: the precise scorer's input. The keys are
        made once per block size, and only when a replica with a view is asked."""
        keys: dict[int, list[bytes]] = {}

        def held(replica: str) -> int:
            size = self.block_size(replica)
            if size is None:
                return 0
            if size not in keys:
                keys[size] = block_keys(namespace, tokens, size)
            return self.matched(keys[size], replica)

        return held

    def clear(self, replica: str, rank: int | None = None) -> None:
        """Empty one replica's view (every rank's, or ``rank``'s): it restarted, cleared its cache, was
        purged, or events were lost."""
        views = self._views.get(replica, {})
        for r in [r for r in views if rank is None or r == rank]:
            view = views.pop(r)
            self._size -= len(view)
            view.empty()
        if not views:
            self._views.pop(replica, None)

    def apply_batch(self, replica: str, batch: Batch, rank: int = 0) -> Applied:
        """One decoded batch of ``rank``'s events applied to that rank's view of ``replica``."""
        if batch.native is None:
            return self.apply(replica, batch.events, rank)
        view = self._view(replica, rank)
        before, size = len(view), view.block_size
        applied = Applied(*view.apply(batch.native))
        self._size += len(view) - before
        if view.block_size != size:
            self._sized(view)
        self._shrink()
        return applied

    def apply(self, replica: str, events: Iterable[Event], rank: int = 0) -> Applied:
        """``rank``'s events applied to that rank's view of ``replica``, one at a time."""
        view = self._view(replica, rank)
        applied = Applied()
        for event in events:
            if isinstance(event, BlockStored):
                self._store(view, event, applied)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if view.remove(block_hash):
                        self._size -= 1
                        applied.removed += 1
            elif isinstance(event, AllBlocksCleared):
                self._size -= len(view)
                view.empty()
                applied.cleared += 1
        self._shrink()
        return applied

    def _view(self, replica: str, rank: int) -> View:
        views = self._views.setdefault(replica, {})
        view = views.get(rank)
        if view is None:
            mirror = self.mirror
            column = None if mirror is None else mirror.column(replica, rank)
            view = views[rank] = View() if mirror is None or column is None else View(mirror.table, column)
        return view

    def _sized(self, view: View) -> None:
        if self.mirror is not None and view.column is not None and view.block_size is not None:
            self.mirror.block_size(view.column, view.block_size)

    def _store(self, view: View, event: BlockStored, applied: Applied) -> None:
        if view.block_size != event.block_size:
            view.block_size = event.block_size
            self._sized(view)
        keyable = _keyable_blocks(event)
        if event.parent_block_hash is None:
            namespace = stored_namespace(event)
            parent = None
            if namespace is None:
                applied.skipped += len(event.block_hashes)
                return
        else:
            namespace = (None, None)
            parent = view.get(event.parent_block_hash)
            if parent is None:  # its chain's start was never seen (or was dropped): not keyable
                applied.skipped += len(event.block_hashes)
                return
        keys = block_keys(
            namespace, event.token_ids[: keyable * event.block_size], event.block_size, parent=parent
        )
        for block_hash, key in zip(event.block_hashes, keys, strict=False):
            if view.add(block_hash, key):
                self._size += 1
            applied.stored += 1
        applied.skipped += len(event.block_hashes) - len(keys)

    def _shrink(self) -> None:
        """Past ``capacity``, the largest view loses its oldest blocks first (down to the next largest,
        then again)."""
        while self._size > self.capacity:
            views = sorted(
                (v for by_rank in self._views.values() for v in by_rank.values()), key=len, reverse=True
            )
            next_largest = len(views[1]) if len(views) > 1 else 0
            count = min(self._size - self.capacity, max(1, len(views[0]) - next_largest))
            self._size -= views[0].pop_oldest(count)
