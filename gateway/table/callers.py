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
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from gateway.core.errors import BadRequest, CallerNotFound, InvalidAdapter, KeysUnavailable
from gateway.core.identity import check_logical_id
from gateway.periodic import periodically, raise_if_cancelling
from gateway.table import keys
from gateway.table.connection import RedisClient
from gateway.table.epoch_table import REDIS_DOWN, Clock, wall_clock_ms

log = logging.getLogger(__name__)

KEY_PREFIX = "kvg-"


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


def _parse(key_id: str, raw: bytes | str) -> tuple[str, Caller]:
    doc = json.loads(raw)
    caller = Caller(key_id, doc["tenant"], frozenset(doc["ids"]), bool(doc["base"]), int(doc["created_ms"]))
    return doc["hash"], caller


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
            doc = {"hash": digest, **caller.to_json()}
            del doc["key_id"]
            if await self.redis.hsetnx(keys.CALLERS, caller.key_id, json.dumps(doc, sort_keys=True)):
                break
        await self.redis.publish(keys.CALLER_HINTS, caller.key_id)
        return key, caller

    async def revoke(self, key_id: str) -> Caller:
        raw = await self.redis.hget(keys.CALLERS, key_id)
        if raw is None or not await self.redis.hdel(keys.CALLERS, key_id):
            raise CallerNotFound(f"no API key with id {key_id!r} (see kvgate keys list)", param="key_id")
        await self.redis.publish(keys.CALLER_HINTS, key_id)
        return _parse(key_id, raw)[1]

    async def read_all(self) -> dict[str, Caller]:
        """Every key, by its hash (what the request path looks up)."""
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.CALLERS)  # type: ignore[assignment]
        return dict(_parse(_text(key_id), doc) for key_id, doc in raw.items())

    async def list(self) -> list[Caller]:
        return sorted((await self.read_all()).values(), key=lambda c: (c.tenant, c.created_ms, c.key_id))


class Callers:
    """This kvgate's copy of the key table; the request path reads only this."""

    def __init__(self, *, max_staleness: float) -> None:
        self.max_staleness = max_staleness
        self._by_hash: dict[str, Caller] = {}
        self.refreshed_at = 0.0

    def find(self, key: str) -> Caller | None:
        """The caller a key belongs to, None for no such key; ``KeysUnavailable`` when the copy is too old
        to trust (a revoke could have been missed)."""
        if self.staleness() > self.max_staleness:
            raise KeysUnavailable(
                "kvgate cannot check API keys right now: its key table has not been readable for "
                f"{self.max_staleness:g} s"
            )
        return self._by_hash.get(key_hash(key))

    def replace(self, by_hash: dict[str, Caller]) -> None:
        self._by_hash = by_hash
        self.refreshed_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_hash)

    def staleness(self) -> float:
        return time.monotonic() - self.refreshed_at if self.refreshed_at else float("inf")


class CallerSync:
    def __init__(self, table: CallerTable, callers: Callers, *, interval: float) -> None:
        self.table = table
        self.callers = callers
        self.interval = interval
        self.reachable = True

    async def reload(self) -> None:
        self.callers.replace(await self.table.read_all())
        self.reachable = True

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
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _dropped(self, exc: Exception) -> None:
        if self.reachable:
            log.warning(
                "API key table unreachable; trusting the last copy for at most %g s: %s",
                self.callers.max_staleness, exc,
            )  # fmt: skip
        self.reachable = False
