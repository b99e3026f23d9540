"""Replica hints: another kvgate saw a replica's loaded adapters change, so refresh that replica now.

The one thing pub/sub still carries (``keys.HINTS``, outside the table's slot); ``SnapshotSync`` runs
``ReplicaHints.listen`` beside its log follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from gateway.table import keys
from gateway.table.connection import RedisClient
from gateway.table.replies import as_text
from gateway.tasks.supervisor import progressed, raise_if_cancelling

log = logging.getLogger(__name__)

ReplicaHint = Callable[[str], Awaitable[None]]


class ReplicaHints:
    def __init__(self, redis: RedisClient, on_replica_hint: ReplicaHint) -> None:
        self.redis = redis
        self.on_replica_hint = on_replica_hint
        """Called with a replica's URL when some kvgate saw its loaded adapters change."""
        self._hinted: dict[str, asyncio.Task[None]] = {}  # replica URL -> its hinted refresh, running
        self._hinted_again: set[str] = set()  # hinted again while its refresh ran: one more refresh

    def _refresh_replica(self, url: str) -> None:
        """Act on a replica hint beside the listener, never inside it: a replica slow to list its adapters
        must not hold back the next hint. One refresh per replica at a time; a hint arriving during it
        asks for one more."""
        if url in self._hinted:
            self._hinted_again.add(url)
            return
        task = asyncio.create_task(self._refresh_until_current(url))
        self._hinted[url] = task
        task.add_done_callback(lambda done: self._refreshed(url, done))

    async def _refresh_until_current(self, url: str) -> None:
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

    async def listen(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.HINTS)
            while True:
                raise_if_cancelling()
                message = await pubsub.get_message(timeout=1.0)
                progressed()  # subscribed and listening: this loop works
                if message is None:
                    continue
                hint = as_text(message["data"])
                if hint.startswith(keys.REPLICA_HINT_PREFIX):
                    self._refresh_replica(hint.removeprefix(keys.REPLICA_HINT_PREFIX))
        finally:
            for task in self._hinted.values():
                task.cancel()
            self._hinted.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
