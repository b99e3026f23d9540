"""Discovery as vLLM serves it: both shapes of ``/kv_event_sources``, every data-parallel rank followed.

The parsing is checked on the answers themselves; the following over real ZMQ: one real XPUB socket per
rank (as vLLM binds one per engine, rank N's port rank 0's + N), named by an in-process HTTP answer in
either shape, the follower under a real ``Supervisor`` as kvgate runs it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from gateway.core.errors import MalformedEvent
from gateway.fleet.replicas import Replica
from gateway.kv.follower import PERIOD_S, STATES, KvFollower, in_state
from gateway.kv.index import PreciseIndex
from gateway.kv.sources import Endpoints, Sources, parse_sources
from gateway.process.http_edge import free_port, running
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.metrics import Metrics
from tests.kv.test_kv_follower import captured, lora_keys
from tests.support.conditions import eventually

HOST = "http://10.0.0.5:8000"


def config(endpoint: str, **more: object) -> dict[str, object]:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv", **more}


def listed(rank: object, endpoint: str, replay: str | None = None) -> dict[str, object]:
    """An entry of the list shape (vLLM's route test): no ``enable_kv_cache_events``, no ``publisher``."""
    return {"data_parallel_rank": rank, "endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}


def test_both_answer_shapes_name_every_rank() -> None:
    by_rank = {"0": config("tcp://*:5557", replay_endpoint="tcp://*:5558"), "1": config("tcp://*:5558")}
    as_list = [listed(1, "tcp://10.0.0.5:5558"), listed(0, "tcp://10.0.0.5:5557", "tcp://*:5558")]
    expected = Sources(
        {
            0: Endpoints("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv"),
            1: Endpoints("tcp://10.0.0.5:5558", None, "kv"),
        }
    )
    assert parse_sources(by_rank, HOST) == expected
    assert parse_sources(as_list, HOST) == expected
    assert parse_sources({"sources": as_list}, HOST) == expected  # the list in an envelope
    assert list(parse_sources(as_list, HOST).ranks) == [0, 1], "in rank order"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("not a dict", "small int"),  # a list entry that is not an object: no rank
        (listed(None, "tcp://*:1"), "small int"),
        (listed(-1, "tcp://*:1"), "small int"),
        (listed(True, "tcp://*:1"), "small int"),
        (listed(0, "tcp://*:1"), "named twice"),  # beside the good rank 0
        (listed(1, "tcp://10.0.0.6:1"), "only tcp:// on the replica's own host"),
        ({**listed(1, "tcp://*:1"), "publisher": "nats"}, "not zmq"),
        ({**listed(1, "tcp://*:1"), "enable_kv_cache_events": False}, "does not publish"),
        ({"data_parallel_rank": 1, "endpoint": 5557}, "not zmq"),
    ],
)
def test_a_malformed_entry_is_skipped_and_the_good_one_kept(bad: object, why: str) -> None:
    sources = parse_sources([listed(0, "tcp://*:5557"), bad], HOST)
    assert sources.ranks == {0: Endpoints("tcp://10.0.0.5:5557", None, "kv")}
    assert len(sources.skipped) == 1
    assert why in sources.skipped[0], sources.skipped


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({}, "no KV event sources"),  # vLLM with events off
        ([], "no KV event sources"),
        ({"sources": []}, "no KV event sources"),
        ("tcp://*:5557", "neither"),
        (None, "neither"),
        ({"x": config("tcp://*:1")}, "small int"),
        ([listed(0, "ipc:///tmp/kv")], "only tcp://"),
    ],
)
def test_an_answer_with_nothing_to_follow_is_refused(answer: object, why: str) -> None:
    with pytest.raises(MalformedEvent, match=why):
        parse_sources(answer, HOST)


@dataclass
class Ranks:
    follower: KvFollower
    index: PreciseIndex
    metrics: Metrics
    url: str
    pubs: list[zmq.asyncio.Socket]

    def state(self) -> str:
        return str(self.follower.health()["state"])

    def gauge(self, state: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "kvgate_kv_events_state", {"replica": self.url, "state": state}
        )


@contextlib.asynccontextmanager
async def ranks(shape: str, count: int = 2, extra: list[object] | None = None) -> AsyncIterator[Ranks]:
    """``count`` real publishers (one per rank, as vLLM binds one per engine), named by the replica's
    ``/kv_event_sources`` in ``shape`` (``by-rank`` or ``list``) with ``extra`` entries beside them; a
    follower under a supervisor, once every rank subscribed."""
    context = zmq.asyncio.Context()
    pubs: list[zmq.asyncio.Socket] = []
    for _ in range(count):
        pub = context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{free_port()}")
        pubs.append(pub)
    ports = [pub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2] for pub in pubs]
    if shape == "by-rank":
        answer: object = {str(rank): config(f"tcp://*:{port}") for rank, port in enumerate(ports)}
    else:
        answer = [listed(rank, f"tcp://*:{port}") for rank, port in enumerate(ports)] + (extra or [])

    async def sources(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    index, metrics = PreciseIndex(10_000), Metrics()
    try:
        async with running(app) as url, aiohttp.ClientSession() as session:
            follower = KvFollower(Replica(url), index, session, metrics, context)
            for state in STATES:  # as follow_events wires it
                metrics.kv_events_state.labels(url, state).set_function(
                    functools.partial(in_state, follower, state)
                )
            async with Supervisor().run("kv-events:r0", follower.run, period=PERIOD_S, required=False):
                for pub in pubs:
                    assert await pub.poll(10_000), "every rank's publisher has its subscriber"
                    assert await pub.recv() == b"\x01kv"
                yield Ranks(follower, index, metrics, url, pubs)
    finally:
        for pub in pubs:
            pub.close()
        context.destroy(linger=0)


@pytest.mark.parametrize("shape", ["by-rank", "list"])
async def test_every_rank_is_followed_and_its_blocks_count_for_the_replica(shape: str) -> None:
    frames = captured("map_frames.json")
    async with ranks(shape) as r:
        await eventually(lambda: r.state() == "following", "both ranks connected")
        assert r.follower.health()["ranks"] == {"0": "following", "1": "following"}
        assert r.follower.health()["routing"] == "exact"
        assert (r.gauge("following"), r.gauge("partial"), r.gauge("unavailable")) == (1.0, 0.0, 0.0)
        await r.pubs[0].send_multipart(frames[0])  # rank 0: the base prompt's 3 blocks
        for message in frames[:3]:  # rank 1, its own sequence from 0: the base's and the LoRA blocks
            await r.pubs[1].send_multipart(message)
        await eventually(lambda: r.index.blocks(r.url) == 12, "3 blocks of rank 0 and 9 of rank 1")
        assert (r.index.blocks(r.url, 0), r.index.blocks(r.url, 1)) == (3, 9)
        assert r.index.matched(lora_keys(), r.url) == 3, "the replica holds what rank 1 holds"
        assert r.follower.health()["blocks"] == 12


async def test_a_lost_rank_empties_its_blocks_only_and_shows_on_health_and_metric() -> None:
    frames = captured("map_frames.json")
    async with ranks("list") as r:
        await r.pubs[0].send_multipart(frames[0])
        for message in frames[:3]:
            await r.pubs[1].send_multipart(message)
        await eventually(lambda: r.index.blocks(r.url) == 12, "both ranks learned")
        r.pubs[1].close()  # rank 1's engine goes away: its connection drops
        await eventually(lambda: r.state() == "partial", "rank 1 is lost, rank 0 still followed")
        health = r.follower.health()
        assert (health["ranks"], health["routing"]) == ({"0": "following", "1": "lost"}, "degraded")
        assert "rank 1: its publisher disconnected" in str(health["reason"])
        assert (r.index.blocks(r.url, 0), r.index.blocks(r.url, 1)) == (3, 0), "never claims rank 1's"
        assert r.index.matched(lora_keys(), r.url) == 0
        assert (r.gauge("partial"), r.gauge("following")) == (1.0, 0.0)
        views = r.metrics.registry.get_sample_value(
            "kvgate_kv_view_resets_total", {"replica": r.url, "reason": "stream lost"}
        )
        assert views == 1
        r.pubs[0].close()
        await eventually(lambda: r.state() == "lost", "no rank left")
        assert r.index.blocks(r.url) == 0
        assert r.gauge("lost") == 1.0
        assert r.follower.health()["routing"] == "predicted"


async def test_a_malformed_entry_beside_a_good_one_is_skipped_counted_and_shown() -> None:
    bad = listed(1, "tcp://169.254.169.254:80")  # a rank naming another host: never connected
    async with ranks("list", count=1, extra=[bad, {"endpoint": "tcp://*:1"}]) as r:
        await eventually(lambda: r.follower.health()["ranks"] == {"0": "following"}, "rank 0 followed")
        health = r.follower.health()
        assert health["state"] == "partial", "a source that cannot be followed: the view may miss blocks"
        assert "skipped a source: refused 'tcp://169.254.169.254:80'" in str(health["reason"])
        skipped = r.metrics.registry.get_sample_value(
            "kvgate_kv_event_sources_skipped_total", {"replica": r.url}
        )
        assert skipped == 2
        await r.pubs[0].send_multipart(captured("map_frames.json")[0])
        await eventually(lambda: r.index.blocks(r.url) == 3, "the good rank's events are applied")


async def test_a_publisher_that_never_answers_is_unavailable() -> None:
    """The replica names a publisher on its own host that nothing listens on: subscribed, but no rank
    connected, so the replica's events are unavailable (not following) with the reason."""
    port = free_port()

    async def sources(request: web.Request) -> web.Response:
        return web.json_response({"0": config(f"tcp://*:{port}")})

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    metrics, context = Metrics(), zmq.asyncio.Context()
    try:
        async with running(app) as url, aiohttp.ClientSession() as session:
            follower = KvFollower(Replica(url), PreciseIndex(100), session, metrics, context)
            async with Supervisor().run("kv-events:r0", follower.run, period=PERIOD_S, required=False):
                await eventually(
                    lambda: "no answer from tcp://127.0.0.1" in follower.state()[1], "retried, unanswered"
                )
                assert follower.state()[0] == "unavailable"
                assert follower.health()["ranks"] == {"0": "connecting"}
    finally:
        context.destroy(linger=0)


async def test_configured_endpoints_are_the_replicas_ranks_in_order() -> None:
    """``kv_event_endpoints`` naming one replica twice: its ranks 0 and 1, each followed into its view."""
    context = zmq.asyncio.Context()
    pubs = []
    for _ in range(2):
        pub = context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{free_port()}")
        pubs.append(pub)
    endpoints = [Endpoints(pub.getsockopt_string(zmq.LAST_ENDPOINT), None, "kv") for pub in pubs]
    index, url = PreciseIndex(100), "http://127.0.0.1:9"
    try:
        async with aiohttp.ClientSession() as session:
            follower = KvFollower(Replica(url), index, session, Metrics(), context, endpoints=endpoints)
            async with Supervisor().run("kv-events:r0", follower.run, period=PERIOD_S, required=False):
                for pub in pubs:
                    assert await pub.poll(10_000), "subscribed"
                    assert await pub.recv() == b"\x01kv"
                await pubs[1].send_multipart(captured("map_frames.json")[0])
                await eventually(lambda: index.blocks(url, 1) == 3, "rank 1's blocks in rank 1's view")
                assert follower.health()["ranks"] == {"0": "following", "1": "following"}
    finally:
        for pub in pubs:
            pub.close()
        context.destroy(linger=0)
