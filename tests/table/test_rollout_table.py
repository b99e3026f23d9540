"""The rollout scripts on a real redis-server (lua/rollout_version.lua, promote_candidate.lua,
abort_rollout.lua) and what the rest of the table does beside a candidate: publish refuses, rollback ends
the rollout, bump moves the candidate's namespace too, gc and forget_version keep its bytes, the change
log and the checksum carry it to every snapshot; the rollout's split key stored with it (the pure split
itself: tests/core/test_split.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from redis import exceptions as redis_exceptions
from redis.asyncio import Redis

from gateway.adapters import gc
from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.errors import BadRequest, MalformedRow, ModelNotFound, RolloutConflict
from gateway.core.model import Candidate, VersionState
from gateway.core.split import rollout_view
from gateway.core.wire import cache_salt
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import forget_version
from gateway.table.rollouts import abort, promote, set_weight, start_rollout, weight_of
from gateway.table.rows import parse_state, row_hash
from gateway.table.scripts import LOGGED, assemble_script
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.table.test_changelog import following
from tests.table.test_epoch_table import BASE, D1, D2, D3, logged, publish


async def candidate(table: EpochTable, digest: str = D2, weight: int = 2500) -> None:
    await start_rollout(
        table, "tenant-42", digest, f"tenant-42@{digest[:16]}", f"/store/{digest}", BASE, weight
    )


async def test_a_rollout_is_a_candidate_beside_the_current_version_logged_and_in_the_history(
    redis: Redis, table: EpochTable
) -> None:
    await publish(table, D1)
    await candidate(table)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch) == (D1, 1), "the current version is untouched"
    assert state.candidate == Candidate(D2, f"tenant-42@{D2[:16]}", f"/store/{D2}", BASE, "", 2500, "user")
    cand = state.candidate_version()
    assert cand is not None
    assert (cand.name, cand.epoch) == (f"tenant-42@{D2[:16]}", 2), "the candidate runs in the next epoch"
    assert cache_salt("g", cand) != cache_salt("g", state), "each version has its own cache namespace"
    ((_, entry),) = [e for e in await logged(redis) if e[1][b"action"] == b"rollout"]
    assert (entry[b"cand_digest"], entry[b"cand_weight"]) == (D2.encode(), b"2500")
    assert await table.has_version("tenant-42", BASE, D2), "the candidate is a recorded version"

    assert not (await set_weight(table, "tenant-42", 2500)).changed, "the same weight changes nothing"
    assert (await set_weight(table, "tenant-42", 5000)).weight == 5000
    with pytest.raises(RolloutConflict, match="promote or abort it first"):
        await candidate(table, D3)  # at most one candidate per ID
    with pytest.raises(RolloutConflict, match="promote or abort it first"):
        await publish(table, D3)
    again = await start_rollout(table, "tenant-42", D2, f"tenant-42@{D2[:16]}", f"/store/{D2}", BASE, 7500)
    assert (again.changed, again.weight) == (True, 7500), "the same candidate again: a weight change"

    aborted = await abort(table, "tenant-42", "operator")
    assert (aborted.digest, aborted.epoch) == (D2, 1), "an abort leaves the epoch (and its cache) alone"
    state = await table.read_state("tenant-42")
    assert state is not None
    assert state.candidate is None
    assert json.loads(state.last_rollout)["outcome"] == "aborted"
    with pytest.raises(RolloutConflict, match="no rollout"):
        await abort(table, "tenant-42", "operator")
    with pytest.raises(RolloutConflict, match="no rollout"):
        await promote(table, "tenant-42")
    with pytest.raises(RolloutConflict, match="no rollout"):
        await set_weight(table, "tenant-42", 100)

    await candidate(table)
    with pytest.raises(RolloutConflict, match="no rollout"):
        await abort(table, "tenant-42", "gate", digest=D3[:16])  # the gate names the one it judged
    promoted = await promote(table, "tenant-42", D2[:8])
    assert (promoted.digest, promoted.epoch) == (D2, 2)
    state = await table.read_state("tenant-42")
    assert state is not None
    assert (state.digest, state.epoch, state.candidate) == (D2, 2, None)
    actions = [(e["action"], e.get("role"), e.get("weight")) for e in await table.read_history("tenant-42")]
    assert actions == [("promote", None, None), ("rollout", "candidate", 2500), ("abort", "candidate", 7500),
                       ("weight", "candidate", 7500), ("weight", "candidate", 5000),
                       ("rollout", "candidate", 2500), ("publish", None, None)]  # fmt: skip


async def test_refusals_of_bad_rollouts(table: EpochTable) -> None:
    with pytest.raises(ModelNotFound, match="no published version"):
        await candidate(table)  # no current version to roll out beside
    await publish(table, D1)
    with pytest.raises(RolloutConflict, match="already"):
        await candidate(table, D1)
    for bad in (-1, 10_001):
        with pytest.raises(BadRequest):
            await candidate(table, D2, bad)
    for percent in (-0.5, 100.5, float("nan"), 12.345):
        with pytest.raises(BadRequest):
            weight_of(percent)
    assert (weight_of(25), weight_of(0.01), weight_of(100)) == (2500, 1, 10_000)
    assert (await table.read_state("tenant-42")).candidate is None  # type: ignore[union-attr]


async def test_rollback_ends_a_rollout_and_skips_its_events_bump_moves_both_namespaces(
    table: EpochTable,
) -> None:
    await publish(table, D1)
    await publish(table, D2)
    await candidate(table, D3)
    bumped = await table.bump("tenant-42")
    state = await table.read_state("tenant-42")
    assert state is not None
    cand = state.candidate_version()
    assert cand is not None
    assert (bumped.epoch, cand.epoch) == (3, 4), "a bump moves the candidate's namespace too"
    change = await table.rollback("tenant-42", "", BASE)
    assert (change.digest, change.epoch) == (D1, 4), "the candidate D3 was never current: not a target"
    state = await table.read_state("tenant-42")
    assert state is not None
    assert state.candidate is None
    assert json.loads(state.last_rollout)["reason"] == "rollback"
    assert [e["action"] for e in await table.read_history("tenant-42")][:2] == ["rollback", "abort"]


async def test_gc_and_forget_never_take_a_candidates_bytes(
    table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), BASE)
    done = await rollout_adapter(table, store, "tenant-42", make_adapter(b"v2"), BASE, 1000)
    assert not await forget_version(table, "tenant-42", done.digest)
    report = await gc.sweep(table, store, gc.Policy(keep_last=1, retention_s=0), {}, dry_run=False)
    kept = {entry.digest: entry.kept_because for entry in report.entries}
    assert "candidate" in kept[done.digest]
    assert isinstance(done.path, Path)  # the directory store
    assert done.path.is_dir()


async def test_every_snapshot_follows_a_rollout_and_the_checksum_agrees(
    redis: Redis, table: EpochTable
) -> None:
    await publish(table, D1)
    async with following(redis) as sync:
        await candidate(table)
        await eventually(lambda: _weight(sync.snapshot.get("tenant-42")) == 2500, "the snapshot has it")
        assert sync.snapshot.current_names() == {f"tenant-42@{D1[:16]}", f"tenant-42@{D2[:16]}"}
        await set_weight(table, "tenant-42", 5000)
        await eventually(lambda: _weight(sync.snapshot.get("tenant-42")) == 5000, "and its new weight")
        beats = sync.counts.heartbeats
        await eventually(lambda: sync.counts.heartbeats >= beats + 3, "three heartbeats")
        assert dict(sync.counts.full_reads) == {"start": 1}, "Lua's row hash and Python's agree"
        assert int((await redis.hget(keys.CHECK, "sum")) or 0) == sync.snapshot.checksum
        await abort(table, "tenant-42", "operator")
        await eventually(lambda: _weight(sync.snapshot.get("tenant-42")) is None, "the abort arrives")
        assert f"tenant-42@{D2[:16]}" in sync.snapshot.retired, "the candidate's name is retired (unloaded)"


def _weight(state: VersionState | None) -> int | None:
    return state.candidate.weight if state is not None and state.candidate is not None else None


def test_half_a_candidate_or_a_bad_weight_is_a_malformed_row() -> None:
    raw = {b"digest": D1.encode(), b"name": b"t@1", b"path": b"/s", b"base": b"base", b"epoch": b"1"}
    assert parse_state("t", raw) is not None
    with pytest.raises(MalformedRow, match="half a rollout candidate"):
        parse_state("t", {**raw, b"cand_digest": D2.encode()})
    full = {**raw, b"cand_digest": D2.encode(), b"cand_name": b"t@2", b"cand_path": b"/s2",
            b"cand_base": b"base", b"cand_base_print": b"", b"cand_weight": b"2500"}  # fmt: skip
    state = parse_state("t", full)
    assert state is not None
    assert row_hash(state) != row_hash(parse_state("t", raw)), "the candidate is in the row's hash"  # type: ignore[arg-type]
    for weight in (b"10001", b"-1", b"02500", b"2.5", b""):
        with pytest.raises(MalformedRow, match="weight"):
            parse_state("t", {**full, b"cand_weight": weight})


async def test_the_split_key_is_stored_with_the_rollout_kept_and_refused_when_unknown(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    await publish(table, D1)
    name, path = f"tenant-42@{D2[:16]}", f"/store/{D2}"
    for bad in ("prefix", "", "USER", "api_key"):
        with pytest.raises(BadRequest, match="is not one of user, api-key, conversation"):
            await start_rollout(table, "tenant-42", D2, name, path, BASE, 2500, split=bad)
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(BadRequest, match="--split-key 'nope'"):
        await rollout_adapter(table, store, "tenant-42", make_adapter(b"v2"), BASE, 2500, split="nope")
    assert not any(store.root.iterdir()) if store.root.exists() else True, "nothing stored"
    before = {key: await redis.dump(key) for key in await redis.keys("*")}
    script = assemble_script("rollout_version")  # straight through Redis: refused before any write
    with pytest.raises(redis_exceptions.ResponseError, match='split key "nope" is not one of'):
        await redis.eval(script, 6, *_keys("tenant-42"), "tenant-42", D2, name, path, BASE, 1, 10_000, 100,
                         "", 2500, "nope")  # fmt: skip
    assert {key: await redis.dump(key) for key in await redis.keys("*")} == before, "no partial state"
    assert (await table.read_state("tenant-42")).candidate is None  # type: ignore[union-attr]

    started = await start_rollout(table, "tenant-42", D2, name, path, BASE, 2500, split="conversation")
    assert started.split == "conversation"
    state = await table.read_state("tenant-42")
    assert state is not None
    assert state.candidate is not None
    assert state.candidate.split == "conversation"
    assert (await set_weight(table, "tenant-42", 5000)).split == "conversation", "a weight change keeps it"
    again = await start_rollout(table, "tenant-42", D2, name, path, BASE, 6000)
    assert (again.weight, again.split) == (6000, "conversation"), "the same candidate, no key: as it runs"
    with pytest.raises(RolloutConflict, match="promote or abort it first"):
        await start_rollout(table, "tenant-42", D2, name, path, BASE, 6000, split="api-key")
    history = await table.read_history("tenant-42")
    assert [(e["action"], e.get("split")) for e in history[:3]] == [
        ("weight", None),
        ("weight", None),
        ("rollout", "conversation"),
    ]
    await promote(table, "tenant-42")
    assert b"cand_split" not in await redis.hkeys(keys.state("tenant-42")), "dropped with the candidate"
    assert (await start_rollout(table, "tenant-42", D3, f"tenant-42@{D3[:16]}", f"/store/{D3}", BASE, 100)
            ).split == "user", "a new rollout with no key: the default"  # fmt: skip


async def test_a_rollout_stored_before_split_keys_splits_by_the_default_and_hashes_as_before(
    redis: Redis, table: EpochTable
) -> None:
    """A candidate without ``cand_split`` (an older kvgate started it): read as the default, and its row
    hashes as it did (Lua's row hash and Python's agree without the field, and with it)."""
    await publish(table, D1)
    await candidate(table)
    await redis.hdel(keys.state("tenant-42"), "cand_split")
    await set_weight(table, "tenant-42", 3000)  # the script logs the row and hashes it without the field
    state = await table.read_state("tenant-42")
    assert state is not None
    assert state.candidate is not None
    assert state.candidate.split == ""
    assert rollout_view(state)["split_key"] == "user"  # type: ignore[index]
    assert int(await redis.hget(keys.ROWS, "tenant-42") or 0) == row_hash(state)
    with_key = replace(state, candidate=replace(state.candidate, split="user"))
    assert row_hash(with_key) != row_hash(state), "a stored split key is in the row's hash"
    change = await start_rollout(table, "tenant-42", D2, f"tenant-42@{D2[:16]}", f"/store/{D2}", BASE, 3000,
                                 split="user")  # fmt: skip
    assert not change.changed, "the default is what it runs by"
    raw: dict[bytes, bytes] = await redis.hgetall(keys.state("tenant-42"))  # type: ignore[assignment]
    for bad in (b"prefix", b"", b"\xff"):
        with pytest.raises(MalformedRow, match="split key"):
            parse_state("tenant-42", {**raw, b"cand_split": bad})


def _keys(logical_id: str) -> list[str]:
    return [keys.state(logical_id), keys.versions(logical_id), keys.history(logical_id), *LOGGED]
