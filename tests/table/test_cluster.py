"""Redis Cluster (three masters, a replica of the first; real servers): the epoch table in its one slot.

The whole table (state, versions, history, the ID index, the change log and its check) shares the hash
tag ``{epochs}``, so every script that changes it writes its change-log entry in the same slot, on the
master that owns it (the first, which has the replica); load locks, leases and replica records keep
their own tags and spread over the three masters. Publish, bump, rollback, load locks, replica records,
full reads (paged, one node), the change log followed by a snapshot, the scrub catching a direct
HINCRBY, and every script that runs declaring keys of one hash slot (seen by ``MONITOR`` on every master,
slots from ``CLUSTER KEYSLOT``; Redis itself refuses a script that touches a key of another slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.table import keys, rollouts
from gateway.table.connection import connect
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import forget_version
from gateway.table.leases import LeaseTable
from gateway.table.rollout_gate import GateTable, read_counts
from gateway.table.scripts import operation_names
from gateway.table.snapshot import Snapshot, SnapshotSync
from gateway.telemetry.rollout_stats import VersionFigures
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.redis_topologies import HOST, ClusterNodes, ServerProcess, kvgate_cli, redis_cluster

MARK = "kvgate-test-monitor-end"


@contextlib.asynccontextmanager
async def evalshas(masters: list[ServerProcess]) -> AsyncIterator[list[list[str]]]:
    """Every EVALSHA the masters run while the block runs (``MONITOR``), as argument lists; the list is
    complete once the block has ended."""
    seen: list[list[str]] = []
    async with contextlib.AsyncExitStack() as stack:
        monitors = []
        for master in masters:
            client = await stack.enter_async_context(master.client())
            monitors.append(await stack.enter_async_context(client.monitor()))
        yield seen
        for master, monitor in zip(masters, monitors, strict=True):
            await master.call("ECHO", MARK)  # everything before it has been reported once this arrives
            while (command := (await monitor.next_command())["command"]) != f"ECHO {MARK}":
                if command.startswith("EVALSHA "):
                    seen.append(command.split(" "))


async def one_id_per_master(nodes: ClusterNodes) -> list[str]:
    """Logical IDs whose load locks live on masters 0, 1 and 2, in that order."""
    found: dict[int, str] = {}
    for i in range(1000):
        owner = await nodes.owner(keys.load_lock(f"tenant-{i}", "x", "http://r1"))
        found.setdefault(owner.port, f"tenant-{i}")
        if len(found) == len(nodes.masters):
            return [found[master.port] for master in nodes.masters]
    raise AssertionError("no logical ID for some master")


async def test_the_epoch_table_on_a_cluster_and_one_slot_per_script(
    make_adapter: MakeAdapter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.table.scripts")
    store = AdapterStore(tmp_path / "store")
    async with redis_cluster(tmp_path / "redis") as nodes, connect(nodes.url) as cluster:
        tenants = await one_id_per_master(nodes)
        table_master = await nodes.owner(keys.LOG)
        assert table_master is nodes.masters[0], (
            "slot 751 is the first master's: its changes wait for the replica"
        )
        for key in (keys.state(tenants[1]), keys.history(tenants[2]), keys.IDS, keys.GENERATION, keys.CHECK):
            assert await nodes.owner(key) is table_master
        table = EpochTable(cluster, ack_timeout=4.0)  # the longest wait: a busy machine is not a failure
        async with evalshas(nodes.masters) as seen:
            snapshot = Snapshot()
            sync = SnapshotSync(table, snapshot, interval=0.2, scrub_page=2)
            following = asyncio.ensure_future(sync.run())
            try:
                for tenant in tenants:
                    v1 = await publish_adapter(
                        table, store, tenant, make_adapter(tenant.encode() + b"1"), "base"
                    )
                    v2 = await publish_adapter(
                        table, store, tenant, make_adapter(tenant.encode() + b"2"), "base"
                    )
                    assert (v1.change.epoch, v2.change.epoch) == (1, 2)
                    assert (await table.bump(tenant)).epoch == 3
                    back = await table.rollback(tenant, "", "base")
                    assert (back.digest, back.epoch) == (v1.digest, 4)
                    assert [event["action"] for event in await table.read_history(tenant)] == [
                        "rollback", "bump", "publish", "publish"
                    ]  # fmt: skip
                    assert not await forget_version(table, tenant, v1.digest)  # current: refused
                    assert await forget_version(table, tenant, v2.digest)  # what gc does before deleting
                waits = [r for r in caplog.records if r.name == "gateway.table.scripts"]
                assert not waits, "the replica acknowledged every change in time"
                assert await replica_reads(nodes.replica, "HGET", keys.state(tenants[0]), "epoch") == b"4"

                view = await table.read_all(page=2)  # paged: SSCAN COUNT 2, a pipeline a page
                assert sorted(view.states) == sorted(tenants)
                assert {state.epoch for state in view.states.values()} == {4}

                await eventually(lambda: epochs(snapshot, tenants, 4), "the log reaches the snapshot", 10.0)
                for tenant in tenants:
                    await table.bump(tenant)
                await eventually(lambda: epochs(snapshot, tenants, 5), "each bump arrives from the log", 10.0)
                await cluster.hincrby(keys.state(tenants[1]), "epoch", 1)  # bypasses the scripts
                await eventually(lambda: epoch_of(snapshot, tenants[1]) == 6, "the scrub logs it", 10.0)
                assert (sync.counts.drift, dict(sync.counts.full_reads)) == (1, {"start": 1})
                assert sync.counts.entries == 4 * 3 + 3 + 1

                await locks_and_replica_records(table, tenants)
                await a_paused_replica_is_reported(table, nodes, tenants, caplog)
            finally:
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await following
        status = await kvgate_cli("status", "--redis-url", nodes.url, "--data-dir", str(tmp_path / "unused"))
        assert all(f"{tenant} " in status for tenant in tenants)

        runs = {command[1] for command in seen}
        assert runs == {table.scripts.registered[name].sha for name in operation_names()}, "every script ran"
        for command in seen:
            declared = command[3 : 3 + int(command[2])]
            slots = set(await slots_of(nodes, declared))
            assert len(slots) == 1, f"a script declared keys of {len(slots)} slots: {declared}"


async def replica_reads(replica: ServerProcess, *command: str) -> Any:
    """COMMAND answered by a cluster replica itself (``READONLY`` first, on the same connection)."""
    async with Redis(host=HOST, port=replica.port, single_connection_client=True) as client:
        await client.execute_command("READONLY")  # type: ignore[no-untyped-call]
        return await client.execute_command(*command)  # type: ignore[no-untyped-call]


def epochs(snapshot: Snapshot, tenants: list[str], epoch: int) -> bool:
    return all(epoch_of(snapshot, tenant) == epoch for tenant in tenants)


def epoch_of(snapshot: Snapshot, tenant: str) -> int:
    state = snapshot.get(tenant)
    return state.epoch if state is not None else 0


async def slots_of(nodes: ClusterNodes, declared: list[str]) -> list[int]:
    return [int(await nodes.masters[0].call("CLUSTER", "KEYSLOT", key)) for key in declared]


async def locks_and_replica_records(table: EpochTable, tenants: list[str]) -> None:
    for tenant in tenants:
        name = f"{tenant}@0123456789abcdef"
        assert await table.acquire_load_lock(tenant, name, "http://r1", "owner-a", 60_000)
        assert not await table.acquire_load_lock(tenant, name, "http://r1", "owner-b", 60_000)
        assert not await table.release_load_lock(tenant, name, "http://r1", "owner-b")
        assert await table.release_load_lock(tenant, name, "http://r1", "owner-a")
        assert await table.acquire_load_lock(tenant, name, "http://r1", "owner-b", 60_000)
    leases, other = LeaseTable(table, "gw-a", ttl_ms=60_000), LeaseTable(table, "gw-b", ttl_ms=60_000)
    for replica in ("http://r1", "http://r2", "http://r3"):  # leases of a replica live in its URL's slot
        name = f"{tenants[0]}@0123456789abcdef"
        assert await other.acquire(replica, name)
        assert not (await leases.begin_unload(replica, name, force=False, claim_ms=60_000)).claimed
        await other.refresh(replica, {name: 1}, set(), since=other.now_ms() + 1)  # gw-b lets go
        assert (await leases.begin_unload(replica, name, force=False, claim_ms=60_000)).claimed
        assert not await other.acquire(replica, name), "no lease while it is being unloaded"
        await leases.end_unload(replica, name, unloaded=True)
    gone = f"{tenants[-1]}-reseeded"
    digest = "ab" * 32
    assert (await table.reseed(gone, digest, f"{gone}@{digest[:16]}", f"/store/{digest}", "base", 7)).changed
    candidate = "cd" * 32  # a rollout's scripts on the cluster too: start, weight, abort, again, promote
    assert (await rollouts.start_rollout(table, gone, candidate, f"{gone}@{candidate[:16]}",
                                         f"/store/{candidate}", "base", 2500)).changed  # fmt: skip
    assert (await rollouts.set_weight(table, gone, 5000)).weight == 5000
    assert (await rollouts.abort(table, gone, "test")).digest == candidate
    await rollouts.start_rollout(table, gone, candidate, f"{gone}@{candidate[:16]}", f"/store/{candidate}",
                                 "base", 2500)  # fmt: skip
    assert (await rollouts.promote(table, gone)).digest == candidate
    for tenant in tenants:  # a rollout's gate and its fleet-wide counts live in its ID's slot
        gate = GateTable(table, "gw-a", ttl_ms=60_000, interval_ms=1_000)
        assert (await gate.take_turn(tenant, candidate)).due
        assert await gate.renew(tenant, candidate)
        await gate.add(tenant, candidate, {"candidate": VersionFigures(requests=2, errors=1)})
        assert (await read_counts(table, tenant, candidate))["candidate"] == VersionFigures(
            requests=2, errors=1
        )
        assert await gate.release(tenant, candidate)
    loaded = {f"{tenant}@0123456789abcdef": f"/store/{tenant}" for tenant in tenants}
    assert await table.record_loaded("http://r1", loaded, 60_000)
    assert not await table.record_loaded("http://r1", loaded, 60_000)  # unchanged: only the TTL
    assert await table.read_loaded() == {"http://r1": loaded}


async def a_paused_replica_is_reported(
    table: EpochTable, nodes: ClusterNodes, tenants: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """WAIT goes to the table's master, on the connection that ran the script: with its replica paused,
    the change stands and a warning says it may not survive a failover."""
    hasty = EpochTable(table.redis, ack_timeout=0.3)
    nodes.replica.pause()
    try:
        await hasty.bump(tenants[0])
        (warning,) = [record for record in caplog.records if record.name == "gateway.table.scripts"]
        assert (
            f"bump_epoch on {keys.state(tenants[0])}: no Redis replica acknowledged" in warning.getMessage()
        )
    finally:
        nodes.replica.resume()
