"""A rollout in the epoch table: a candidate beside an ID's current version, its weight, promote, abort.

One Lua script per operation (``lua/rollout_version.lua``: start or change the weight;
``lua/promote_candidate.lua``; ``lua/abort_rollout.lua``), each logged in the change log like a publish,
so every kvgate's snapshot has the candidate as soon as it has the entry, and each waits for a Redis
replica's acknowledgement like publish (``Scripts.run_acked``). Weights are basis points
(``core.model.WEIGHT_FULL``); ``weight_of`` turns an operator's percent into one. A rollout's split key
(``core.split.SPLIT_KEYS``, ``split_of``) is set when it starts and kept until it ends.
"""

from __future__ import annotations

import math

from gateway.core.errors import BadRequest
from gateway.core.model import WEIGHT_FULL, Change, RolloutChange
from gateway.core.split import SPLIT_KEYS
from gateway.table.epoch_table import EpochTable


def weight_of(percent: float) -> int:
    """An operator's percent (0..100, at most two decimals' worth) as basis points; bad input refused."""
    if not math.isfinite(percent) or not 0 <= percent <= 100:
        raise BadRequest(f"--percent {percent!r} must be between 0 and 100", param="percent")
    weight = round(percent * 100)
    if abs(weight - percent * 100) > 1e-6:
        raise BadRequest(f"--percent {percent!r}: at most two decimals (basis points)", param="percent")
    return weight


def split_of(name: str | None) -> str:
    """An operator's split key, refused unless it is one of ``SPLIT_KEYS`` (None: '', which the script
    reads as the running rollout's, or ``DEFAULT_SPLIT`` for a new one)."""
    if name is None:
        return ""
    if name not in SPLIT_KEYS:
        raise BadRequest(f"--split-key {name!r} is not one of {', '.join(SPLIT_KEYS)}", param="split_key")
    return name


def _weight(weight: int) -> int:
    if not 0 <= weight <= WEIGHT_FULL:
        raise BadRequest(f"weight {weight} must be 0..{WEIGHT_FULL} basis points", param="percent")
    return weight


async def start_rollout(
    table: EpochTable,
    logical_id: str,
    digest: str,
    name: str,
    path: str,
    base: str,
    weight: int,
    base_print: str = "",
    split: str | None = None,
) -> RolloutChange:
    """DIGEST (stored at PATH, built for BASE) becomes LOGICAL_ID's candidate at WEIGHT basis points, its
    requests split by SPLIT (one of ``SPLIT_KEYS``; None: the default, or the running rollout's when
    DIGEST is its candidate already)."""
    version = [digest, name, path, base]
    return await _rollout(table, logical_id, version, base_print, _weight(weight), split_of(split))


async def set_weight(table: EpochTable, logical_id: str, weight: int) -> RolloutChange:
    """The running rollout's candidate gets WEIGHT basis points (``RolloutConflict`` when none runs)."""
    return await _rollout(table, logical_id, ["", "", "", ""], "", _weight(weight), "")


async def _rollout(
    table: EpochTable, logical_id: str, version: list[str], base_print: str, weight: int, split: str
) -> RolloutChange:
    digest, name, path, base = version
    with table.tracer.start_as_current_span("kvgate.rollout"):
        return await table.scripts.rollout_version(
            logical_id, digest, name, path, base, base_print, weight, split, now=table.clock()
        )


async def promote(table: EpochTable, logical_id: str, digest: str = "") -> Change:
    """The candidate (DIGEST or a prefix of it, when given) becomes current under a new epoch."""
    with table.tracer.start_as_current_span("kvgate.promote"):
        return await table.scripts.promote_candidate(logical_id, digest, now=table.clock())


async def abort(table: EpochTable, logical_id: str, reason: str, digest: str = "") -> Change:
    """Drop the candidate (DIGEST or a prefix of it, when given); REASON goes into the history."""
    with table.tracer.start_as_current_span("kvgate.abort"):
        return await table.scripts.abort_rollout(logical_id, digest, reason, now=table.clock())
