"""A table that comes back empty is an event, not a silent 404 for every tenant.

When Redis loses its data (``FLUSHALL``, a restart without its append-only file), the next read finds a
new table generation. The reconcile that first sees it hands the snapshot it still holds to
``Reseeder.reseed``, before the snapshot is replaced: the event is logged (a warning) and counted, and
every version the snapshot can prove is written back. A snapshot row (digest, name, path, base, epoch)
proves its bytes when its path is the store's content-addressed directory for that digest and the
directory exists: the store never changes a directory once written. Each goes back through one
``reseed_version`` script per logical ID, which writes only if the ID has no version in the new
generation, or one only a reseed wrote at a lower epoch (so several kvgates can reseed at once, in any
order, and end at the freshest version they held; a publish made meanwhile wins), and records a
``reseeded`` history event. ``health()`` is what ``/healthz`` shows.

Proving asks the store (a ``stat`` of a directory, or a ``HEAD`` of a manifest on an object store), so it
runs in the default executor's worker threads, at most ``PROVING_AT_ONCE`` versions at a time: requests
keep being served meanwhile (the snapshot a reseed holds still answers them), and the round trips to an
object store overlap instead of following one another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from gateway.core.model import VersionState
from gateway.table.epoch_table import EpochTable
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

Proves = Callable[[str, str], bool]
"""``proves(digest, path)``: the store holds DIGEST's bytes at PATH."""

RESEEDED, ALREADY_PRESENT, UNPROVEN = "reseeded", "already_present", "unproven"
PROVING_AT_ONCE = 16


class Reseeder:
    def __init__(self, table: EpochTable, proves: Proves, metrics: Metrics) -> None:
        self.table = table
        self.proves = proves
        self.metrics = metrics
        self.new_generations = 0
        self.last_new_generation_at: float | None = None  # wall clock (s) this kvgate first saw it
        self._generation = ""  # the last new generation handled
        self._outcomes: dict[str, str] = {}  # logical ID -> outcome, under that generation

    async def reseed(self, held: Iterable[VersionState], generation: str) -> bool:
        """Write back what ``held`` (the snapshot from before the new GENERATION) proves; True when
        anything was written (the caller reads the table again). Safe to call again after a failure."""
        if generation != self._generation:
            self._new_generation(generation)
        wrote = False
        pending = [state for state in held if state.logical_id not in self._outcomes]
        for start in range(0, len(pending), PROVING_AT_ONCE):
            batch = pending[start : start + PROVING_AT_ONCE]
            proven = await asyncio.gather(*(asyncio.to_thread(self.proves, s.digest, s.path) for s in batch))
            for state, held_bytes in zip(batch, proven, strict=True):
                outcome = await self._put_back(state) if held_bytes else self._unproven(state)
                wrote = wrote or outcome == RESEEDED
                self._outcomes[state.logical_id] = outcome
                self.metrics.reseeded_versions.labels(outcome).inc()
        return wrote

    def _new_generation(self, generation: str) -> None:
        self._generation = generation
        self._outcomes = {}
        self.new_generations += 1
        self.last_new_generation_at = time.time()
        self.metrics.new_generations.inc()
        log.warning(
            "the epoch table came back empty (new generation %s): re-seeding the versions this kvgate's "
            "snapshot can prove",
            generation,
        )

    def _unproven(self, state: VersionState) -> str:
        log.warning(
            "cannot re-seed %s: the store does not hold %s (publish it again)", state.name, state.path
        )
        return UNPROVEN

    async def _put_back(self, state: VersionState) -> str:
        change = await self.table.reseed(
            state.logical_id, state.digest, state.name, state.path, state.base, state.epoch
        )
        if not change.changed:
            return ALREADY_PRESENT
        log.info("re-seeded %s at epoch %d", state.name, state.epoch)
        return RESEEDED

    def health(self) -> dict[str, Any]:
        """The last new generation this kvgate saw and what its reseed did (counts of logical IDs)."""
        outcomes = list(self._outcomes.values())
        return {
            "new_generations": self.new_generations,
            "last_new_generation_at": self.last_new_generation_at,
            RESEEDED: outcomes.count(RESEEDED),
            ALREADY_PRESENT: outcomes.count(ALREADY_PRESENT),
            UNPROVEN: outcomes.count(UNPROVEN),
        }
