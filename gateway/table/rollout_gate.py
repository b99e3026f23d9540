"""The rollout gate's shared state in Redis: which kvgate process gates a rollout, and its fleet's figures.

**One gate per rollout per interval.** Every worker of every kvgate runs the gate's ticks, and at each one
asks for the rollout's turn (``lua/take_gate_turn.lua``): the first to ask holds a lease on it
(``kvg:{ID}:gate:DIGEST``), renewed by its own asks (and, while its audit round runs, by
``lua/renew_gate.lua``), and only the holder judges and audits; the lease of a holder that stopped asking
(it died, or hangs) expires after ``ttl_ms`` and the next asker takes it. The
start of the last audit round is kept beside the holder, so an audit round is due at most once per
interval, fleet-wide, across a take-over too.

**Fleet-wide figures.** Each worker adds what its own traffic of the rollout counted since its last tick
(``lua/add_rollout_counts.lua``: requests, errors, time to first byte per role) to one hash
(``kvg:{ID}:rollout-counts:DIGEST``), so the holder judges the error rates of every kvgate's traffic, not
its own slice. Both keys are named by the candidate's digest: the next rollout starts with no holder and
no counts, and both expire by themselves once nobody writes. What Redis holds is read at this boundary:
a field that is not one kvgate writes is skipped with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from gateway.core.split import ROLES
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.replies import as_text
from gateway.table.scripts import Code
from gateway.telemetry.rollout_stats import FIGURES, VersionFigures, by_role

log = logging.getLogger(__name__)
COUNTS_TTL_MS = 7 * 24 * 3600 * 1000
"""The fleet-wide counts of a rollout live on this long after the last add (a week)."""


@dataclass(frozen=True, slots=True)
class Turn:
    holder: str  # the gateway id whose lease holds the rollout's gate
    mine: bool  # this gateway holds it
    due: bool  # an audit round is due now, and this gateway runs it
    until_ms: int  # the lease's expiry (wall clock, ms)
    round_ms: int  # when the last audit round began (0: none yet)

    def to_json(self) -> dict[str, Any]:
        return {"holder": self.holder, "mine": self.mine, "until_ms": self.until_ms,
                "last_round_ms": self.round_ms or None}  # fmt: skip


class GateTable:
    """GATEWAY_ID's side of the gates of running rollouts: leases of TTL_MS, rounds INTERVAL_MS apart."""

    def __init__(self, table: EpochTable, gateway_id: str, *, ttl_ms: int, interval_ms: int) -> None:
        self.table = table
        self.gateway_id = gateway_id
        self.ttl_ms = ttl_ms
        self.interval_ms = interval_ms

    async def take_turn(self, logical_id: str, digest: str) -> Turn:
        code, holder, until, round_ms = await self.table.scripts.take_gate_turn(
            logical_id, digest, self.gateway_id,
            now=self.table.clock(), ttl_ms=self.ttl_ms, interval_ms=self.interval_ms,
        )  # fmt: skip
        return Turn(holder, code is not Code.LEASED, code is Code.CHANGED, until, round_ms)

    async def renew(self, logical_id: str, digest: str) -> bool:
        """Keep this gateway's lease on the rollout's gate while it audits (no round asked for); False
        when it no longer holds it."""
        return await self.table.scripts.renew_gate(
            logical_id, digest, self.gateway_id,
            now=self.table.clock(), ttl_ms=self.ttl_ms, interval_ms=self.interval_ms,
        )  # fmt: skip

    async def release(self, logical_id: str, digest: str) -> bool:
        """Let go of the rollout's gate if this gateway holds it (it stops): the next asker takes it."""
        return await self.table.scripts.release_gate(logical_id, digest, self.gateway_id)

    async def add(self, logical_id: str, digest: str, figures: dict[str, VersionFigures]) -> None:
        """Add FIGURES (role -> what this worker counted since its last add) to the fleet's."""
        amounts = {
            f"{role}:{name}": value
            for role, counted in figures.items()
            for name, value in counted.counts().items()
            if value
        }
        if amounts:
            await self.table.scripts.add_rollout_counts(logical_id, digest, amounts, ttl_ms=COUNTS_TTL_MS)

    async def figures(self, logical_id: str, digest: str) -> dict[str, VersionFigures]:
        return await read_counts(self.table, logical_id, digest)


async def read_counts(table: EpochTable, logical_id: str, digest: str) -> dict[str, VersionFigures]:
    """Role -> the rollout's figures over every kvgate's traffic, as far as each has added them."""
    key = keys.rollout_counts(logical_id, digest)
    return parse_counts(key, await table.redis.hgetall(key))


async def read_holder(table: EpochTable, logical_id: str, digest: str) -> Turn | None:
    """Who holds the rollout's gate, read without asking for it (``kvgate status``); None: nobody."""
    raw = await table.redis.hgetall(keys.rollout_gate(logical_id, digest))
    fields = {as_text(k, "replace"): as_text(v, "replace") for k, v in raw.items()}
    holder, until = fields.get("holder"), _whole(fields.get("until_ms"))
    if holder is None or until is None or until <= table.clock():
        return None
    return Turn(holder, False, False, until, _whole(fields.get("round_ms")) or 0)


def parse_counts(key: str, raw: dict[Any, Any]) -> dict[str, VersionFigures]:
    """A counts hash as Redis holds it, one field at a time: ``ROLE:FIGURE`` -> a whole number >= 0."""
    figures = by_role()
    for name, value in raw.items():
        field, text = as_text(name, "replace"), as_text(value, "replace")
        role, _, figure = field.partition(":")
        count = _whole(text)
        if role not in ROLES or figure not in FIGURES or count is None:
            log.warning("%s field %r = %r is not what kvgate writes: skipped", key, field[:60], text[:40])
            continue
        setattr(figures[role], figure, count)
    return figures


def _whole(text: str | None) -> int | None:
    """A whole number >= 0 as Redis writes one, or None."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)
