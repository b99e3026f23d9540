"""API keys: who may call kvgate, as which tenant, for which logical IDs (and the base model or not).

A key is ``kvg-`` + 43 random URL-safe characters (``secrets.token_urlsafe(32)``), shown once when it is
made. Redis keeps only its blake3 hash, under a short non-secret key id (the first hex of that hash) that
``kvgate keys list`` shows and ``kvgate keys revoke`` takes (layout in ``keys.py``). Keys carry 256 random
bits, so a fast hash is the right one: there is nothing to brute-force.

``CallerTable`` is the Redis side (create, list, revoke: each one plain command, then a hint). ``Callers``
is each kvgate's local copy, the only thing the request path reads (no Redis command per request);
``CallerSync`` keeps it fresh like the epoch-table snapshot: a full re-read every ``interval`` and at
once on a hint. A revoke therefore takes effect within ``interval`` on every kvgate that reaches Redis
(at once, usually, through the hint). A copy that has not been re-read for ``max_staleness`` seconds
trusts no key (``KeysUnavailable``, 503) until Redis answers: the bound holds while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from gateway.core.errors import BadRequest, CallerNotFound, InvalidAdapter, KeysUnavailable, MalformedRow
from gateway.core.identity import check_logical_id
from gateway.table import keys
from gateway.table.connection import RedisClient
from gateway.table.epoch_table import REDIS_DOWN, Clock, wall_clock_ms
from gateway.table.replies import as_text
from gateway.tasks.supervisor import periodically, progressed, raise_if_cancelling
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

KEY_PREFIX = "kvg-"
_HASH = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Caller:
    """What one API key may do: its tenant (the base model's cache namespace), its logical IDs, the base."""

    key_id: str
    tenant: str
    ids: frozenset[str]
    base: bool
    created_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "tenant": self.tenant, "ids": sorted(self.ids), "base": self.base,
                "created_ms": self.created_ms}  # fmt: skip


def may_use(caller: Caller | None, logical_id: str) -> bool:
    """Whether a caller (None: unrestricted, keys off or the operator) may use a logical ID."""
    return caller is None or logical_id in caller.ids


def may_use_base(caller: Caller | None) -> bool:
    return caller is None or caller.base


def key_hash(key: str) -> str:
    return blake3(key.encode()).hexdigest()


def check_grant(tenant: str, ids: Iterable[str], *, base: bool) -> frozenset[str]:
    """What a new key may use, checked: tenant names follow the logical-ID rules (plain names, no ``@``,
    no braces), every logical ID is a valid one, and the key allows something."""
    try:
        check_logical_id(tenant)
    except InvalidAdapter as exc:
        raise BadRequest(
            f"invalid tenant {tenant!r}: use 1-128 of [A-Za-z0-9._-], first a letter or digit", param="tenant"
        ) from exc
    allowed = frozenset(check_logical_id(logical_id) for logical_id in ids)
    if not allowed and not base:
        raise BadRequest("a key needs at least one --id or --base: it would allow nothing", param="ids")
    return allowed


def parse_row(key_id: bytes | str, raw: bytes | str) -> tuple[str, Caller]:
    """One row of the key table (key id -> JSON) as (key hash, caller); ``MalformedRow`` when it is not
    one ``CallerTable.create`` writes."""
    try:
        key_id, text = as_text(key_id), as_text(raw)
    except UnicodeDecodeError:
        raise MalformedRow("the key id or its row is not UTF-8") from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise MalformedRow(f"key {key_id}: not JSON") from None
    if not isinstance(doc, dict):
        raise MalformedRow(f"key {key_id}: not a JSON object")
    digest, tenant, ids, base, created = (doc.get(f) for f in ("hash", "tenant", "ids", "base", "created_ms"))
    if not isinstance(digest, str) or not _HASH.fullmatch(digest) or not digest.startswith(key_id):
        raise MalformedRow(f"key {key_id}: its hash is missing or not this key id's")
    if not isinstance(tenant, str) or not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise MalformedRow(f"key {key_id}: its tenant or logical IDs are missing or not strings")
    if not isinstance(base, bool) or isinstance(created, bool) or not isinstance(created, int):
        raise MalformedRow(f"key {key_id}: 'base' is not true/false or 'created_ms' is not a number")
    return digest, Caller(key_id, tenant, frozenset(ids), base, created)


def _row(digest: str, caller: Caller) -> str:
    """The JSON row ``CallerTable.create`` writes (``parse_row`` reads it back)."""
    doc = {"hash": digest, **caller.to_json()}
    del doc["key_id"]
    return json.dumps(doc, sort_keys=True)


def _ids(by_hash: dict[str, Caller]) -> set[str]:
    return {caller.key_id for caller in by_hash.values()}


@dataclass(frozen=True)
class KeyRead:
    """One read of the key table: the keys by hash, the rows that are no key (key id -> why), and
    whether the table carries its mark (``keys.CALLERS_MARK``: it was made, so it is not a wiped one)."""

    by_hash: dict[str, Caller]
    malformed: dict[str, str]
    mark: str | None  # the table's mark (None: it has none: never made, or wiped)


class CallerTable:
    def __init__(self, redis: RedisClient, *, clock: Clock = wall_clock_ms) -> None:
        self.redis = redis
        self.clock = clock

    async def create(self, tenant: str, ids: Iterable[str], *, base: bool) -> tuple[str, Caller]:
        """A new key for ``tenant``: returns the key (its only appearance) and what it may do."""
        allowed = check_grant(tenant, ids, base=base)
        while True:  # a key id is 48 bits of the hash: a clash is astronomically rare, but never silent
            key = KEY_PREFIX + secrets.token_urlsafe(32)
            digest = key_hash(key)
            caller = Caller(digest[: keys.KEY_ID_LENGTH], tenant, allowed, base, self.clock())
            await self.mark()
            if await self.redis.hsetnx(keys.CALLERS, caller.key_id, _row(digest, caller)):
                break
        await self.redis.publish(keys.CALLER_HINTS, caller.key_id)
        return key, caller

    async def revoke(self, key_id: str) -> Caller:
        raw = await self.redis.hget(keys.CALLERS, key_id)
        if key_id == keys.CALLERS_MARK or raw is None or not await self.redis.hdel(keys.CALLERS, key_id):
            raise CallerNotFound(f"no API key with id {key_id!r} (see kvgate keys list)", param="key_id")
        await self.redis.publish(keys.CALLER_HINTS, key_id)
        try:
            return parse_row(key_id, raw)[1]
        except MalformedRow:  # a malformed row is revoked all the same (it was no key)
            return Caller(key_id, "?", frozenset(), False, 0)

    async def read(self) -> KeyRead:
        """Every key, by its hash (what the request path looks up); a malformed row is left out and
        named, never the read's failure."""
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.CALLERS)  # type: ignore[assignment]
        by_hash: dict[str, Caller] = {}
        malformed: dict[str, str] = {}
        mark: str | None = None
        for key_id, doc in raw.items():
            if key_id == keys.CALLERS_MARK.encode():
                mark = doc.decode(errors="replace")
                continue
            try:
                digest, caller = parse_row(key_id, doc)
            except MalformedRow as exc:
                malformed[key_id.decode(errors="replace")] = exc.reason
                continue
            by_hash[digest] = caller
        return KeyRead(by_hash, malformed, mark)

    async def read_all(self) -> dict[str, Caller]:
        return (await self.read()).by_hash

    async def list(self) -> tuple[list[Caller], dict[str, str]]:
        """Every key, by tenant, and the malformed rows (key id -> why)."""
        read = await self.read()
        ordered = sorted(read.by_hash.values(), key=lambda c: (c.tenant, c.created_ms, c.key_id))
        return ordered, read.malformed

    async def put_back(self, by_hash: dict[str, Caller]) -> int:
        """Write back keys a kvgate held, each only where its id is absent, and the table's mark; how
        many were written."""
        written = 0
        for digest, caller in by_hash.items():
            written += bool(await self.redis.hsetnx(keys.CALLERS, caller.key_id, _row(digest, caller)))
        await self.mark()
        if written:
            await self.redis.publish(keys.CALLER_HINTS, keys.CALLERS_MARK)
        return written

    async def mark(self) -> None:
        """Mark the table as made (a random token, kept while the table lives)."""
        await self.redis.hsetnx(keys.CALLERS, keys.CALLERS_MARK, secrets.token_hex(8))

    async def forget(self, key_ids: Iterable[str]) -> None:
        """Delete rows of keys known revoked (another kvgate wrote them back from an older copy)."""
        for key_id in key_ids:
            await self.redis.hdel(keys.CALLERS, key_id)


class Callers:
    """This kvgate's copy of the key table; the request path reads only this."""

    def __init__(self, *, max_staleness: float, metrics: Metrics | None = None) -> None:
        self.max_staleness = max_staleness
        self.metrics = metrics
        self._by_hash: dict[str, Caller] = {}
        self.refreshed_at = 0.0
        self.malformed: dict[str, str] = {}  # key id -> why its row is no key, as last read
        self.wiped_at: float | None = None  # wall clock (s) the table was last found wiped
        self.restored = 0  # keys this kvgate wrote back then
        self.lost = 0  # keys it held then but could not write back (its copy too old to trust)

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` says of the API keys: how many, the malformed rows, the last wipe."""
        return {"keys": len(self), "malformed": dict(self.malformed), "wiped_at": self.wiped_at,
                "restored": self.restored, "lost": self.lost}  # fmt: skip

    def find(self, key: str) -> Caller | None:
        """The caller a key belongs to, None for no such key; ``KeysUnavailable`` when the copy is too old
        to trust (a revoke could have been missed)."""
        if self.staleness() > self.max_staleness:
            raise KeysUnavailable(
                "kvgate cannot check API keys right now: its key table has not been readable for "
                f"{self.max_staleness:g} s"
            )
        return self._by_hash.get(key_hash(key))

    def held(self) -> dict[str, Caller]:
        return dict(self._by_hash)

    def replace(self, by_hash: dict[str, Caller]) -> None:
        self._by_hash = by_hash
        self.refreshed_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_hash)

    def staleness(self) -> float:
        return time.monotonic() - self.refreshed_at if self.refreshed_at else float("inf")


class CallerSync:
    """Keeps ``Callers`` fresh. A malformed row is that key's problem: left out, logged once, counted,
    named by ``Callers.health`` and ``kvgate keys list``. A table found wiped (it lost its
    ``CALLERS_MARK``, or has another one: ``FLUSHALL``, Redis back empty) is re-seeded from this kvgate's
    copy when that copy is fresh (read within two intervals, Redis reachable since), never with a key
    this kvgate saw revoked; a key it saw revoked that another kvgate wrote back is deleted again. A copy
    too old to trust is not written back: every key is gone, and ``Callers.health`` and the log say so."""

    def __init__(self, table: CallerTable, callers: Callers, *, interval: float) -> None:
        self.table = table
        self.callers = callers
        self.interval = interval
        self.reachable = True
        self.revoked: set[str] = set()  # key ids this kvgate saw go from the table it had read
        self._mark: str | None = None
        self._reading = asyncio.Lock()  # the periodic re-read and the hinted one: one at a time

    async def reload(self) -> None:
        async with self._reading:
            await self._reload()

    async def _reload(self) -> None:
        read = await self.table.read()
        held = self.callers.held()
        if read.mark is None and (read.by_hash or read.malformed):
            await self.table.mark()  # a table from before the mark: marked as made now
        elif held and (read.mark is None or (self._mark is not None and read.mark != self._mark)):
            read = await self._wiped(read, held)
        if read.mark is not None and read.mark == self._mark:  # the same table: what went was revoked
            self.revoked |= {caller.key_id for caller in held.values()} - _ids(read.by_hash)
        back = _ids(read.by_hash) & self.revoked
        if back:
            log.warning("API keys %s were revoked, then written back (from an older copy): deleting them",
                        ", ".join(sorted(back)))  # fmt: skip
            await self.table.forget(back)
        self._mark = read.mark if read.mark is not None else self._mark
        by_hash = {digest: c for digest, c in read.by_hash.items() if c.key_id not in self.revoked}
        for key_id, reason in read.malformed.items():
            if self.callers.malformed.get(key_id) != reason:
                log.error("API key table: row %s is malformed, that key is refused: %s", key_id, reason)
                if self.callers.metrics is not None:
                    self.callers.metrics.malformed_rows.labels("caller").inc()
        self.callers.malformed = dict(read.malformed)
        self.callers.replace(by_hash)
        self.reachable = True

    async def _wiped(self, read: KeyRead, held: dict[str, Caller]) -> KeyRead:
        self.callers.wiped_at = time.time()
        fresh = self.reachable and self.callers.staleness() <= 2 * self.interval
        if not fresh:
            self.callers.lost, self.callers.restored = len(held), 0
            log.error(
                "the API key table came back empty, and this kvgate's copy (%.0f s old) is too old to "
                "write back (a revoke may have been missed): every API key is gone; create them again",
                self.callers.staleness(),
            )
            return read
        keep = {digest: c for digest, c in held.items() if c.key_id not in self.revoked}
        self.callers.restored, self.callers.lost = await self.table.put_back(keep), 0
        log.warning(
            "the API key table came back empty: wrote back %d of the %d keys this kvgate held",
            self.callers.restored, len(keep),
        )  # fmt: skip
        return await self.table.read()

    async def run(self) -> None:
        """Run until cancelled: the periodic re-read and the hint listener side by side."""
        async with asyncio.TaskGroup() as group:
            group.create_task(
                periodically(self.interval, self.reload, survive=REDIS_DOWN, on_error=self._dropped)
            )
            group.create_task(
                periodically(self.interval, self._listen, survive=REDIS_DOWN, on_error=self._dropped)
            )

    async def _listen(self) -> None:
        pubsub = self.table.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(keys.CALLER_HINTS)
            await self.reload()  # changes made before the subscription are covered by a full read
            while True:
                raise_if_cancelling()
                if await pubsub.get_message(timeout=1.0) is not None:
                    await self.reload()
                progressed()  # subscribed and listening: this loop works
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    def _dropped(self, exc: Exception) -> None:
        if self.reachable:
            log.warning(
                "API key table unreachable; trusting the last copy for at most %g s: %s",
                self.callers.max_staleness, exc,
            )  # fmt: skip
        self.reachable = False
