"""Space-Saving (Metwally, Agrawal, El Abbadi, 2005): the heaviest keys of a stream in bounded memory.

The sketch holds at most ``capacity`` keys with a count each. A key already held gains its weight; a new
key takes a free entry, or else replaces the key with the smallest count and starts from that count plus
its weight (so a count never underestimates), remembering the count it inherited as its ``error``.
Guarantees, with N the total weight added: every key whose true count exceeds N / capacity is held, and
a held key's true count lies between ``count - error`` and ``count``, with ``error`` ≤ N / capacity.
``top`` ranks by the guaranteed part, ``count - error``: a key that just replaced another has inherited
a count it never earned, and must not outrank keys that earned theirs (in a long tail of keys seen once,
every newcomer inherits about N / capacity). ``decay`` multiplies every count and error by a factor, so
the ranking follows recent traffic.

The smallest entry is found with a heap of (count, key) pairs updated lazily: a pair is current when it
equals the key's count in ``counts``; stale pairs are skipped when popped and the heap is rebuilt from
``counts`` when it holds too many of them, so memory stays O(capacity) and an update costs O(log capacity).
"""

from __future__ import annotations

import heapq


class SpaceSaving:
    __slots__ = ("_heap", "capacity", "counts", "errors")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.counts: dict[str, float] = {}
        self.errors: dict[str, float] = {}
        """Key -> the count it inherited when it replaced another (absent: none)."""
        self._heap: list[tuple[float, str]] = []

    def add(self, key: str, weight: float = 1.0) -> None:
        count = self.counts.get(key)
        if count is None:
            if self.capacity <= 0:
                return
            if len(self.counts) >= self.capacity:
                count = self.errors[key] = self._evict_smallest()
            else:
                count = 0.0
        count += weight
        self.counts[key] = count
        heapq.heappush(self._heap, (count, key))
        if len(self._heap) > 2 * self.capacity + 64:
            self._rebuild()

    def top(self, k: int) -> list[str]:
        """The ``k`` keys with the largest guaranteed counts, largest first (ties: by count, then key)."""

        def rank(item: tuple[str, float]) -> tuple[float, float, str]:
            key, count = item
            return (self.errors.get(key, 0.0) - count, -count, key)

        return [key for key, _ in heapq.nsmallest(k, self.counts.items(), key=rank)]

    def decay(self, factor: float) -> None:
        """Multiply every count by ``factor`` (0 < factor ≤ 1): older traffic weighs less."""
        self.counts = {key: count * factor for key, count in self.counts.items()}
        self.errors = {key: error * factor for key, error in self.errors.items()}
        self._rebuild()

    def _evict_smallest(self) -> float:
        while True:
            count, key = heapq.heappop(self._heap)
            if self.counts.get(key) == count:
                del self.counts[key]
                self.errors.pop(key, None)
                return count

    def _rebuild(self) -> None:
        self._heap = [(count, key) for key, count in self.counts.items()]
        heapq.heapify(self._heap)
