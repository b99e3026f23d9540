"""Each kvgate's local copy of the epoch table: the hot path reads this, never Redis.

``SnapshotSync`` keeps it fresh from the change log (changelog.py): one full read at start (paged),
then it follows ``kvg:{epochs}:log`` with ``XREAD BLOCK`` from the last entry it applied (work grows
with the changes, not with the table). A heartbeat every ``interval`` runs lua/heartbeat.lua and reads
the log's ends: a new generation (Redis came back empty), a position the log no longer leads on from
(``Ends.parted``: trimmed, or rewound) or a checksum that disagrees once the snapshot holds the check's
``last`` (``Agreement``: a change refused half way) triggers a full read; a check it cannot read or a
heartbeat refused fails it (the supervisor then makes ``/healthz`` 503). Bound: docs/redis.md.
Writes that bypass the scripts reach it as 'drift' entries the shared scrub logs. When the Redis
connection drops, the snapshot is marked ``flushed``: it keeps serving what it had (a versioned name
always means the same bytes, so a lagging snapshot serves the previous version coherently, never a mix),
and when Redis answers again it catches up from the log, or reads in full if the log no longer reaches
back that far. A new table generation rebuilds it, after the ``Reseeder`` (reseed.py) has written back
what the snapshot held and can prove. Pub/sub stays for one thing: replica hints (hints.py).

With a ``SnapshotFile`` (snapshot_file.py) the start reads no table: it loads the file, checks that the
table's generation is the file's, applies the log from the file's position, and lets a heartbeat confirm
the checksum; another generation, a position trimmed off the log or a checksum that disagrees once caught
up set the file aside (counted) for a full read. The file is rewritten every ``interval`` it moved.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from gateway.core.model import TableView, VersionState
from gateway.table import keys
from gateway.table.changelog import START, Agreement, ChangeLog, Entry, entry_id
from gateway.table.epoch_table import REDIS_DOWN, REDIS_REFUSED, EpochTable
from gateway.table.hints import ReplicaHint, ReplicaHints
from gateway.table.replies import as_text
from gateway.table.reseed import Reseeder
from gateway.table.rows import row_hash
from gateway.table.snapshot_file import Saved, SnapshotFile
from gateway.tasks.supervisor import periodically, progressed, raise_if_cancelling
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class Snapshot:
    def __init__(self, on_epoch_change: Callable[[str], None] = lambda logical_id: None) -> None:
        self.on_epoch_change = on_epoch_change
        self.generation = ""
        self.position = ""
        """The newest change-log entry applied ('' before the first full read)."""
        self.checksum = 0
        """The sum of ``row_hash`` over what it holds: the table's check sum when both agree."""
        self._states: dict[str, VersionState] = {}
        self.retired: dict[str, float] = {}
        """Versioned names that stopped being current, with the monotonic time they did."""
        self.refreshed_at = 0.0
        """Monotonic time it last held every change the table had (a full read, or a heartbeat whose
        newest entry it had applied by then): ``staleness`` grows while the follower cannot advance."""
        self.malformed: dict[str, str] = {}
        """Logical ID -> why its state row is unreadable, as the last full read found it (left out; counted on
        /healthz, named in its detail view)."""
        self.flushed = True  # nothing read yet, or the Redis connection dropped since the last read

    def get(self, logical_id: str) -> VersionState | None:
        return self._states.get(logical_id)

    def __iter__(self) -> Iterator[VersionState]:
        return iter(list(self._states.values()))

    def current_names(self) -> set[str]:  # every versioned name served: current ones and candidates
        return {version.name for version in self.versions()}

    def versions(self) -> Iterator[VersionState]:  # each version served (a candidate as one of its own)
        return iter([version for state in self._states.values() for version in state.versions()])

    def size(self) -> int:
        return len(self._states)

    def restore(self, saved: Saved | None) -> None:
        """Into an empty snapshot, a snapshot file's content (its checksum as the file says, its digest
        vouching for it), not yet current; None: empty again (the file set aside), nothing read."""
        at = (saved.generation, saved.position, saved.checksum) if saved else ("", "", 0)
        self._states, self.malformed = (saved.states, saved.malformed) if saved else ({}, {})
        (self.generation, self.position, self.checksum), self.refreshed_at, self.flushed = at, 0.0, True

    def replace(self, view: TableView, position: str = START) -> None:
        new_table = bool(self.generation) and view.generation != self.generation
        # an ID whose row is malformed keeps what the snapshot held: it serves the previous version (a lagging
        # snapshot is coherent), not a 404, while status and /healthz name the row
        gone = (
            self._states.keys()
            if new_table
            else self._states.keys() - view.states.keys() - view.malformed.keys()
        )
        for logical_id in list(gone):  # a new generation (Redis came back empty): nothing carries over
            self.put(logical_id, None)
        for state in view.states.values():
            self.put(state.logical_id, state)
        if new_table:  # epochs restarted under a new generation: every namespace changed
            for logical_id in view.states:
                self.on_epoch_change(logical_id)
        self.generation = view.generation
        self.malformed = dict(view.malformed)
        self.position = position
        self.refreshed_at = time.monotonic()
        self.flushed = False

    def put(self, logical_id: str, state: VersionState | None) -> None:
        previous = self._states.get(logical_id)
        self.checksum += (row_hash(state) if state else 0) - (row_hash(previous) if previous else 0)
        kept = {version.name for version in state.versions()} if state is not None else set()
        for gone in {v.name for v in previous.versions()} - kept if previous else ():  # an abort: a candidate
            self.retired.setdefault(gone, time.monotonic())
        if state is None:
            self._states.pop(logical_id, None)
        else:
            self._states[logical_id] = state
            if previous is not None and previous.epoch != state.epoch:
                self.on_epoch_change(logical_id)
            for name in kept:
                self.retired.pop(name, None)

    def staleness(self) -> float:
        return time.monotonic() - self.refreshed_at if self.refreshed_at else float("inf")


LISTEN_RETRY_S = 0.5  # a dropped log read or hint subscription is retried this soon
BLOCK_S = 2.0  # the longest one XREAD BLOCK waits (less with a short socket timeout: longest_block)


@dataclass
class SyncCounts:
    """What the sync did since it started (tests and the scale loadtest read these)."""

    full_reads: collections.Counter[str] = field(default_factory=collections.Counter)
    """By reason: start, generation, trimmed, rewound (``Ends.parted``), checksum."""
    heartbeats: int = 0
    entries: int = 0  # change-log entries applied
    drift: int = 0  # of them, 'drift' entries: the scrub saw a write that bypassed the scripts
    malformed: int = 0  # entries skipped: not what the scripts write (a direct XADD)


class SnapshotSync:
    def __init__(
        self, table: EpochTable, snapshot: Snapshot, *, interval: float, reseeder: Reseeder | None = None,
        on_replica_hint: ReplicaHint | None = None, block: float = BLOCK_S, scrub_page: int = keys.SCRUB_PAGE,
        metrics: Metrics | None = None, file: SnapshotFile | None = None,
    ) -> None:  # fmt: skip
        self.table = table
        self.log = ChangeLog(table, scrub_page=scrub_page)
        self.snapshot = snapshot
        self.interval = interval
        """Seconds between heartbeats (and between the shared scrub's steps)."""
        self.block = self.log.longest_block(block)
        self.reseeder = reseeder
        self.hints = ReplicaHints(table.redis, on_replica_hint) if on_replica_hint is not None else None
        self.file = file
        """Where the snapshot is kept between starts (None: every start reads the table in full)."""
        self.counts = SyncCounts()
        self.metrics = metrics
        self._reading = asyncio.Lock()  # full reads, log entries and heartbeats: one at a time
        self._agreement = Agreement()
        self._beat: tuple[str, float] | None = None  # (newest entry, monotonic time) of a beat not caught up

    async def reconcile(self, reason: str = "start") -> None:
        """A full read (paged), then follow the log from the newest entry before it; at the start, the
        snapshot file instead when it is there and Redis confirms it."""
        async with self._reading:
            first = reason == "start" and not self.snapshot.position
            if first and self.file is not None and await self._from_file(self.file):
                return
            await self._full_read(reason)

    async def _from_file(self, file: SnapshotFile) -> bool:
        """Load FILE, check its generation, apply the log from its position, confirm with a heartbeat."""
        saved = await asyncio.to_thread(file.load)
        if saved is None:
            return False
        if (generation := as_text(await self.table.redis.get(keys.GENERATION) or b"")) != saved.generation:
            file.reject("generation", f"the file's table is {saved.generation}, Redis holds {generation!r}")
            return False
        snapshot = self.snapshot
        snapshot.restore(saved)  # not current until Redis says so
        self._agreement.unchanged = [saved.position]
        while entries := await self.log.read(snapshot.position, block_ms=None):
            if await self.log.trimmed_past(snapshot.position):
                return self._set_aside(file, "trimmed", f"the log no longer reaches back to {saved.position}")
            for entry in entries:
                self._apply(entry)
        beat = await self.log.heartbeat(scrub_every_ms=int(self.interval * 1000))
        if beat.generation != snapshot.generation:
            return self._set_aside(file, "generation", f"the table became {beat.generation!r} meanwhile")
        if parted := (ends := await self.log.ends()).parted(position := snapshot.position):  # an older copy
            return self._set_aside(file, "ahead" if parted == "rewound" else "trimmed",
                                   f"the log was {parted} ({ends.last_id}) past {position}")  # fmt: skip
        if self._agreement.disagrees(beat, snapshot.checksum):
            return self._set_aside(file, "checksum", "caught up, its rows' checksum is not the table's")
        snapshot.flushed = False
        self._confirm(ends.last_id, time.monotonic())
        file.count("loaded")
        file.written = (saved.generation, saved.position)
        log.info("started from %s (%d IDs at %s, %.0f s old), caught up to %s", file.path, snapshot.size(),
                 saved.position, time.time() - saved.written_at, snapshot.position)  # fmt: skip
        return True

    def _set_aside(self, file: SnapshotFile, outcome: str, reason: str) -> bool:
        file.reject(outcome, reason)
        self.snapshot.restore(None)
        self._beat = None
        return False

    async def save(self) -> None:
        """Write the snapshot file when the snapshot moved since the last one and Redis confirmed it."""
        file, snapshot = self.file, self.snapshot
        if file is None or snapshot.flushed or not snapshot.position or not snapshot.refreshed_at:
            return
        if (snapshot.generation, snapshot.position) != file.written:  # one copy at one position: no await
            await file.save(snapshot.generation, snapshot.position, snapshot.checksum, list(snapshot),
                            dict(snapshot.malformed))  # fmt: skip

    async def _full_read(self, reason: str) -> None:
        self.counts.full_reads[reason] += 1
        if self.metrics is not None:
            self.metrics.full_reads.labels(reason).inc()
        if reason != "start":
            log.warning("reading the epoch table in full: %s", reason)
        position, logged = await self.log.head(), await self.log.logged()
        view = await self.table.read_all()
        new_table = bool(self.snapshot.generation) and view.generation != self.snapshot.generation
        if new_table and self.reseeder and await self.reseeder.reseed(self.snapshot, view.generation):
            position, logged = await self.log.head(), await self.log.logged()
            view = await self.table.read_all()  # with what was re-seeded
        for logical_id, reason in view.malformed.items():
            if self.snapshot.malformed.get(logical_id) != reason:
                log.error("epoch table: the state of %r is malformed, left out of the snapshot: %s",
                          logical_id, reason)  # fmt: skip
                if self.metrics is not None:
                    self.metrics.malformed_rows.labels("state").inc()
        self.snapshot.replace(view, position)
        self._agreement.unchanged = [logged, position]
        self._beat = None

    async def run(self) -> None:
        """Run until cancelled: the log follower, the heartbeat, (with a hook) the replica hints and (with
        a file) its writer."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._forever(LISTEN_RETRY_S, self._follow))
            group.create_task(self._forever(self.interval, self.heartbeat))
            if self.hints is not None:
                group.create_task(self._forever(LISTEN_RETRY_S, self.hints.listen))
            if self.file is not None and self.file.interval > 0:
                group.create_task(self._forever(self.file.interval, self.save))

    async def _forever(self, interval: float, step: Callable[[], Awaitable[None]]) -> None:
        """A step that Redis fails (down, or refusing a command) is retried after INTERVAL; any other
        failure ends ``run``, and its supervisor restarts it (logged, counted, on /healthz)."""
        await periodically(interval, step, survive=REDIS_DOWN + REDIS_REFUSED, on_error=self._dropped)

    def _dropped(self, exc: Exception) -> None:
        if not isinstance(exc, REDIS_DOWN):  # Redis answers but refused: the snapshot stays trusted
            log.warning("the epoch table refused a command (retrying): %s", exc)
            return
        if not self.snapshot.flushed:
            log.warning("epoch table unreachable, serving the last snapshot until it answers: %s", exc)
        self.snapshot.flushed = True

    async def heartbeat(self) -> None:
        """Compare the snapshot with the table's check; a new generation or a mismatch reads it in full."""
        reads, beat = self.counts.full_reads.total(), await self.log.heartbeat(int(self.interval * 1000))
        self.counts.heartbeats += 1
        async with self._reading:
            if self.counts.full_reads.total() != reads:  # one ran while the beat was on its way: it is newer
                return
            ends = await self.log.ends()  # the follower waits: the position cannot move meanwhile
            if not self.snapshot.position:
                await self._full_read("start")
            elif beat.generation != self.snapshot.generation and not self.snapshot.generation:
                self.snapshot.generation = beat.generation  # the table was made after an empty read: logged
            elif beat.generation != self.snapshot.generation:
                await self._full_read("generation")
            elif parted := ends.parted(self.snapshot.position):  # logged: "reading ... in full: rewound"
                await self._full_read(parted)
            elif self._agreement.disagrees(beat, self.snapshot.checksum):
                await self._full_read("checksum")
            self.snapshot.flushed = False
            self._confirm(ends.last_id, time.monotonic())

    def _confirm(self, last: str, at: float) -> None:
        """The table's newest entry was LAST at AT: if the snapshot has applied it, it was current then;
        else it will have been once the follower applies it (``_applied``)."""
        position = self.snapshot.position
        if position and entry_id(position) >= entry_id(last):
            self.snapshot.refreshed_at = max(self.snapshot.refreshed_at, at)
            self._beat = None
        elif self._beat is None:
            self._beat = (last, at)  # the oldest unconfirmed beat: staleness counts from the last confirmed

    def _applied(self) -> None:
        if self._beat is not None:
            self._confirm(*self._beat)

    async def _follow(self) -> None:
        """Apply the log's entries as they come, from the snapshot's position."""
        while True:
            raise_if_cancelling()
            if self.snapshot.flushed:  # start, or Redis answers again: its generation first
                await self.heartbeat()
            position = self.snapshot.position
            entries = await self.log.read(position, block_ms=int(self.block * 1000))
            progressed()  # following: this loop works
            if not entries:
                continue
            async with self._reading:
                if position != self.snapshot.position:
                    continue  # a full read moved it meanwhile: read on from there
                if await self.log.trimmed_past(position):
                    log.warning("the change log was trimmed past this snapshot's position %s", position)
                    await self._full_read("trimmed")
                    continue
                for entry in entries:
                    self._apply(entry)
                self._applied()

    def _apply(self, entry: Entry) -> None:
        if entry.malformed:  # skipped: what it should have said, the checksum and the scrub repair
            self.counts.malformed += 1
            if self.metrics is not None:
                self.metrics.malformed_rows.labels("change_log").inc()
            log.error("epoch table: skipped a malformed change-log entry: %s", entry.malformed)
            self.snapshot.position = entry.position
            self._agreement.applied(entry.position, changed=False)
            return
        self.counts.entries += 1
        if self.metrics is not None:
            self.metrics.log_entries.labels(entry.action).inc()
        self.snapshot.position = entry.position
        self._agreement.applied(entry.position, changed=True)
        held = self.snapshot.get(entry.logical_id)
        if entry.action == "drift":
            self.counts.drift += 1
            log.warning("epoch table: %s was changed outside kvgate's scripts", entry.logical_id)
        elif held is not None and entry.state is not None and entry.state.epoch < held.epoch:
            return  # older than what a full read already showed
        self.snapshot.put(entry.logical_id, entry.state)
