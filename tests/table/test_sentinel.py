"""Redis behind Sentinel (a master, a replica, three sentinels; real servers): the master dies mid-traffic.

kvgate keeps answering from its snapshot while the sentinels fail over, then follows the new master: a
publish through the CLI lands there and kvgate serves it. Publishes wait for the replica's acknowledgement.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table import keys
from gateway.table.connection import connect
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.redis_topologies import MASTER_NAME, kvgate_cli, sentinel_group, texts
from tests.support.stub_backend import StubState, build_stub
from tests.table.test_redis_outage import health

BODY = {"model": "tenant-42", "prompt": "p", "max_tokens": 1}


async def served_version(http: aiohttp.ClientSession, url: str) -> str:
    """The versioned name kvgate answers tenant-42 with (the request must succeed)."""
    async with http.post(f"{url}/v1/completions", json=BODY) as response:
        assert response.status == 200, await response.text()
        return response.headers["x-kvgate-version"]


async def test_kvgate_serves_through_a_failover_then_follows_the_new_master(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    async with sentinel_group(tmp_path / "redis") as group, connect(group.url) as redis:
        patient = EpochTable(redis, ack_timeout=4.0)  # the longest wait: a busy machine is not a failure
        v1 = await publish_adapter(patient, store, "tenant-42", make_adapter(b"v1"), "base")
        # The publish waited for the replica: it holds v1 before anything happens to the master.
        assert await group.replica.call("HGET", keys.state("tenant-42"), "digest") == v1.digest.encode()
        async with running(build_stub(StubState())) as stub_url:
            settings = Settings(replicas=[stub_url], store=store.root, redis_url=group.url,
                                reconcile_interval=0.1, poll_interval=0.1)  # fmt: skip
            async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:
                assert await served_version(http, url) == v1.name  # loads v1 (its lock is in Redis)

                group.master.kill()
                group.replica.pause()  # no master, and none to promote: kvgate is on its own

                async def flushed() -> bool:
                    return (await health(http, url))["snapshot_flushed"] is True

                await eventually(flushed, "kvgate notices the master is gone", 30.0)
                for _ in range(5):
                    assert await served_version(http, url) == v1.name  # from the snapshot

                group.replica.resume()

                async def promoted() -> bool:
                    assert await served_version(http, url) == v1.name  # still, meanwhile
                    return await group.master_ports() == {group.replica.port}

                await eventually(promoted, "every sentinel names the replica as the master", 45.0)

                v2_dir = make_adapter(b"v2")
                published = json.loads(await kvgate_cli(
                    "publish", "tenant-42", str(v2_dir), "--json", "--redis-url", group.url,
                    "--store", str(store.root), "--data-dir", str(tmp_path / "unused"),
                ))  # fmt: skip
                assert published["epoch"] == 2
                new_master_state = await group.replica.call("HGETALL", keys.state("tenant-42"))
                assert new_master_state[b"digest"] == str(published["digest"]).encode()

                async def serving_v2() -> bool:
                    return await served_version(http, url) == str(published["name"])

                await eventually(serving_v2, "kvgate serves the version published on the new master", 30.0)
                assert (await health(http, url))["snapshot_flushed"] is False
    assert not (tmp_path / "unused").exists(), "with a Redis URL the CLI starts no embedded Redis"


async def test_changes_wait_for_the_replica_and_warn_when_it_does_not_answer(
    make_adapter: MakeAdapter, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.table.scripts")
    store = AdapterStore(tmp_path / "store")
    state = keys.state("tenant-42")
    async with sentinel_group(tmp_path / "redis") as group, connect(group.url) as redis:
        patient = EpochTable(redis, ack_timeout=4.0)  # the longest wait: a busy machine is not a failure
        await publish_adapter(patient, store, "tenant-42", make_adapter(b"v1"), "base")
        assert not caplog.records

        group.replica.pause()  # connected, so the master counts it, but it acknowledges nothing
        bump = asyncio.ensure_future(patient.bump("tenant-42"))

        async def written_on_master() -> bool:
            return bool(await group.master.call("HGET", state, "epoch") == b"2")

        await eventually(written_on_master, "the bump is written on the master", 3.0)
        assert not bump.done(), "the bump returned before any replica acknowledged it"
        group.replica.resume()
        assert (await asyncio.wait_for(bump, 10)).epoch == 2
        assert await group.replica.call("HGET", state, "epoch") == b"2"
        assert not caplog.records, "the replica acknowledged in time: no warning"

        group.replica.pause()
        hasty = EpochTable(redis, ack_timeout=0.2)
        assert (await hasty.bump("tenant-42")).epoch == 3  # the change stands on the master ...
        (warning,) = caplog.records  # ... and the operator is told it is not yet safe from a failover
        assert "no Redis replica acknowledged it within 0.2 s" in warning.getMessage()
        assert "bump_epoch" in warning.getMessage()
        group.replica.resume()

        unhurried = EpochTable(redis, ack_timeout=0)  # 0: never waits, even with the replica paused
        group.replica.pause()
        assert (await unhurried.bump("tenant-42")).epoch == 4
        assert len(caplog.records) == 1
        group.replica.resume()


async def test_every_sentinel_client_is_closed_after_racing_lookups(tmp_path: Path) -> None:
    """Master lookups that race move sentinels around in redis-py's own list, and one can drop out of it;
    kvgate closes every sentinel client it made all the same (else their connections stay open)."""
    async with sentinel_group(tmp_path / "redis") as group:
        async with connect(group.url) as redis:  # the first sentinel answered: it is first in the list
            await group.sentinels[0].call(
                "SENTINEL", "REMOVE", MASTER_NAME
            )  # now it answers, but knows no master
            assert all(await asyncio.gather(*(redis.ping() for _ in range(50))))  # 50 lookups at once

        async def only_peers_and_this_probe() -> bool:
            for sentinel in group.sentinels:
                connected = texts(await sentinel.call("CLIENT", "LIST")).splitlines()
                if len([line for line in connected if " name=sentinel-" not in line]) > 1:  # not a peer
                    return False
            return True

        await eventually(only_peers_and_this_probe, "kvgate's connections to the sentinels are closed", 5.0)
