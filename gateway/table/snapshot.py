"""Each kvgate's local copy of the epoch table: the hot path reads this, never Redis.

``SnapshotSync`` keeps it fresh two ways: a pub/sub listener re-reads one logical ID per hint, and a
periodic full reconcile (default 1 s) replaces everything, catching hints that were missed or
mutations made straight through Redis. When the Redis connection drops, the snapshot is marked
``flushed``: it keeps serving what it had (a versioned name always means the same bytes, so a lagging
snapshot serves the previous version coherently, never a mix) and is rebuilt wholesale, not patched,
as soon as Redis answers again. A new table generation (Redis came back empty) also rebuilds it, after
the ``Reseeder`` (reseed.py) has written back what the snapshot held and can prove.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

from gateway.core.model import TableView, VersionState
from gateway.periodic import periodically, raise_if_cancelling
from gateway.table import keys
from gateway.table.epoch_table import REDIS_DOWN, EpochTable
from gateway.table.reseed import Reseeder

log = logging.getLogger(__name__)


class Snapshot:
    def __init__(self, on_epoch_change: Callable[[str], None] = lambda logical_id: None) -> None:
        self.on_epoch_change = on_epoch_change
        self.generation = ""
        self._states: dict[str, VersionState] = {}
        self.retired: dict[str, float] = {}
        """Versioned names that stopped being current, with the monotonic time they did."""
        self.refreshed_at = 0.0
        self.flushed = True  # nothing read yet, or the Redis connection dropped since the last read

    def get(self, logical_id: str) -> VersionState | None:
        return self._states.get(logical_id)

    def __iter__(self) -> Iterator[VersionState]:
        return iter(list(self._states.values()))

    def current_names(self) -> set[str]:
        return {state.name for state in self._states.values()}

    def replace(self, view: TableView) -> None:
        new_table = bool(self.generation) and view.generation != self.generation
        gone = self._states.keys() if new_table else self._states.keys() - view.states.keys()
        for logical_id in list(gone):  # a new generation (Redis came back empty): nothing carries over
            self.put(logical_id, None)
        for state in view.states.values():
            self.put(state.logical_id, state)
        if new_table:  # epochs restarted under a new generation: every namespace changed
            for logical_id in view.states:
                self.on_epoch_change(logical_id)
        self.generation = view.generation
        self.refreshed_at = time.monotonic()
        self.flushed = False

    def put(self, logical_id: str, state: VersionState | None) -> None:
        previous = self._states.get(logical_id)
        if previous is not None and (state is None or previous.name != state.name):
            self._retire(previous)
        if state is None:
            self._states.pop(logical_id, None)
        else:
            self._states[logical_id] = state
            if previous is not None and previous.epoch != state.epoch:
                self.on_epoch_change(logical_id)
            self.retired.pop(state.name, None)

    def _retire(self, state: VersionState) -> None:
        self.retired.setdefault(state.name, time.monotonic())

    def staleness(self) -> float:
        return time.monotonic() - self.refreshed_at if self.refreshed_at else float("inf")


ReplicaHint = Callable[[str], Awaitable[None]]
LISTEN_RETRY_S = 0.5  # a dropped hint subscription is retried this soon, whatever the reconcile interval


class SnapshotSync:
    def __init__(
        self,
        table: EpochTable,
        snapshot: Snapshot,
        *,
        interval: float,
        reseeder: Reseeder | None = None,
        on_replica_hint: ReplicaHint | None = None,
    ) -> None:
        self.table = table
        self.snapshot = snapshot
        self.interval = interval
        self.reseeder = reseeder
        self.on_replica_hint = on_replica_hint
        """Called with a replica's URL when some kvgate saw its loaded adapters change."""
        self._reading = asyncio.Lock()  # the listener and the periodic loop both reconcile: one at a time
        self._hinted: dict[str, asyncio.Task[None]] = {}  # replica URL -> its hinted refresh, running
        self._hinted_again: set[str] = set()  # hinted again while its refresh ran: one more refresh

    async def reconcile(self) -> None:
        async with self._reading:
            view = await self.table.read_all()
            new_table = bool(self.snapshot.generation) and view.generation != self.snapshot.generation
            if new_table and self.reseeder and await self.reseeder.reseed(self.snapshot, view.generation):
                view = await self.table.read_all()  # with what was re-seeded
            self.snapshot.replace(view)

    async def run(self) -> None:
        """Run until cancelled: the hint listener and the periodic reconcile side by side."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._reconcile_forever())
            group.create_task(self._listen_forever())

    async def _reconcile_forever(self) -> None:
        await periodically(self.interval, self.reconcile, survive=REDIS_DOWN, on_error=self._dropped)

    async def _listen_forever(self) -> None:
        await periodically(LISTEN_RETRY_S, self._listen, survive=REDIS_DOWN, on_error=self._dropped)

    def _dropped(self, exc: Exception) -> None:
        if not self.snapshot.flushed:
            log.warning("epoch table unreachable, serving the last snapshot until it answers: %s", exc)
        self.snapshot.flushed = True

    def _refresh_replica(self, url: str) -> None:
        """Act on a replica hint beside the listener, never inside it: a replica slow to list its adapters
        must not hold back the table's hints. One refresh per replica at a time; a hint arriving during it
        asks for one more."""
        if url in self._hinted:
            self._hinted_again.add(url)
            return
        task = asyncio.create_task(self._refresh_until_current(url))
        self._hinted[url] = task
        task.add_done_callback(lambda done: self._refreshed(url, done))

    async def _refresh_until_current(self, url: str) -> None:
        assert self.on_replica_hint is not None
        while True:
            self._hinted_again.discard(url)
            await self.on_replica_hint(url)
            if url not in self._hinted_again:
                return

    def _refreshed(self, url: str, task: asyncio.Task[None]) -> None:
        if self._hinted.get(url) is task:
            del self._hinted[url]
        if not task.cancelled() and task.exception() is not None:
            log.error("refreshing %s on its hint failed", url, exc_info=task.exception())

    async def _listen(self) -> None:
        pubsub = self.table.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.HINTS)
            await self.reconcile()  # hints sent before the subscription are covered by a full read
            while True:
                raise_if_cancelling()
                message = await pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                hint = message["data"].decode() if isinstance(message["data"], bytes) else message["data"]
                if not hint.startswith(keys.REPLICA_HINT_PREFIX):
                    self.snapshot.put(hint, await self.table.read_state(hint))
                elif self.on_replica_hint is not None:
                    self._refresh_replica(hint.removeprefix(keys.REPLICA_HINT_PREFIX))
        finally:
            for task in self._hinted.values():
                task.cancel()
            self._hinted.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
