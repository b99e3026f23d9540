"""The KV event follower over real ZMQ sockets, fed the frames captured from a real vLLM replica.

The publisher here is a real pyzmq XPUB socket (it answers once the follower has subscribed) and, for
gap repair, a ROUTER speaking vLLM's replay protocol (``ZmqEventPublisher._service_replay``: a request
``[identity, b"", start_seq]``, answered ``[identity, b"", topic, seq, payload]`` per batch, then an end
marker with sequence -1). A follower whose attempt fails is restarted by a real ``Supervisor``, as kvgate
runs it. tests/vllm/test_precise_vllm.py runs the follower against vLLM itself.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from gateway.core.errors import MalformedEvent
from gateway.fleet.replicas import Replica
from gateway.kv.events import BlockStored, decode_message
from gateway.kv.follower import PERIOD_S, KvFollower
from gateway.kv.index import PreciseIndex, block_keys
from gateway.kv.sources import Endpoints, parse_endpoint_setting, parse_sources
from gateway.process.http_edge import free_port, running
from gateway.request.status_page import kv_event_fields
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "kv_events"
URL = "http://127.0.0.1:9"


def captured(name: str) -> list[list[bytes]]:
    return [[base64.b64decode(f) for f in e["frames"]] for e in json.loads((FIXTURES / name).read_text())]


def lora_keys() -> list[bytes]:
    event = decode_message(captured("map_frames.json")[2]).events[0]
    assert isinstance(event, BlockStored)
    return block_keys(("t@1", "kvg-abc"), event.token_ids, 128)


def rank0(answer: object, replica_url: str) -> Endpoints:
    return parse_sources(answer, replica_url).ranks[0]


def test_endpoints_from_the_captured_sources_answer() -> None:
    answer = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:18411",
              "replay_endpoint": "tcp://*:18412", "buffer_steps": 10000, "topic": "kv"},
    }  # fmt: skip
    assert rank0(answer, "http://10.0.0.5:8000") == Endpoints(
        "tcp://10.0.0.5:18411", "tcp://10.0.0.5:18412", "kv"
    )
    with pytest.raises(MalformedEvent, match="does not publish"):
        rank0({"0": {"enable_kv_cache_events": False}}, URL)
    with pytest.raises(MalformedEvent):
        rank0({}, URL)
    assert parse_endpoint_setting("http://r:8000/=tcp://h:1|tcp://h:2") == (
        "http://r:8000",
        Endpoints("tcp://h:1", "tcp://h:2"),
    )
    with pytest.raises(ValueError, match="REPLICA_URL"):
        parse_endpoint_setting("http://r:8000")


def sources_answer(endpoint: str, replay: str | None = None) -> dict[str, object]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    return {"0": config if replay is None else {**config, "replay_endpoint": replay}}


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [
        ("tcp://169.254.169.254:80", None),  # another host (a cloud's metadata service)
        ("tcp://10.0.0.6:18411", None),
        ("ipc:///run/kvgate/admin.sock", None),  # a path on kvgate's own host
        ("inproc://x", None),
        ("tcp://eth0;10.0.0.5:18411", None),  # ZMQ's source-address form
        ("tcp://*:notaport", None),
        ("tcp://*:18411", "tcp://169.254.169.254:80"),  # the replay socket elsewhere
        ("tcp://*:18411", "ipc:///tmp/replay"),
    ],
)
def test_an_event_source_off_the_replicas_own_host_is_refused(endpoint: str, replay: str | None) -> None:
    with pytest.raises(
        MalformedEvent, match=r"only tcp:// on the replica's own host \(10.0.0.5\) is followed"
    ):
        rank0(sources_answer(endpoint, replay), "http://10.0.0.5:8000")


def test_an_event_source_on_the_replicas_own_host_is_followed() -> None:
    own = rank0(sources_answer("tcp://10.0.0.5:1", "tcp://0.0.0.0:2"), "http://10.0.0.5:8000")
    assert own == Endpoints("tcp://10.0.0.5:1", "tcp://10.0.0.5:2", "kv")
    v6 = rank0(sources_answer("tcp://*:1", "tcp://[::1]:2"), "http://[::1]:8000")
    assert v6 == Endpoints("tcp://[::1]:1", "tcp://[::1]:2", "kv")
    named = rank0(sources_answer("tcp://Replica-0:1"), "http://replica-0:8000")
    assert named == Endpoints("tcp://replica-0:1", None, "kv")


@dataclass
class Publisher:
    socket: zmq.asyncio.Socket
    endpoints: Endpoints

    async def send(self, frames: list[bytes]) -> None:
        await self.socket.send_multipart(frames)


@dataclass
class Followed:
    follower: KvFollower
    index: PreciseIndex
    metrics: Metrics
    replica: Replica
    publisher: Publisher

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"replica": URL, **labels}) or 0.0


@asynccontextmanager
async def following(replay: list[list[bytes]] | None = None) -> AsyncIterator[Followed]:
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    router = None
    tasks: list[asyncio.Task[None]] = []
    replay_endpoint = None
    if replay is not None:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        router.bind(replay_endpoint)
        tasks.append(asyncio.create_task(_serve_replay(router, replay)))
    index, metrics, replica = PreciseIndex(10_000), Metrics(), Replica(URL)
    endpoints = Endpoints(endpoint, replay_endpoint, "kv")
    async with aiohttp.ClientSession() as session:
        follower = KvFollower(replica, index, session, metrics, context, endpoints=[endpoints])
        tasks.append(asyncio.create_task(follower.run()))
        try:
            assert await pub.poll(10_000), "the follower subscribed"
            assert await pub.recv() == b"\x01kv"
            yield Followed(follower, index, metrics, replica, Publisher(pub, endpoints))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pub.close()
            if router is not None:
                router.close()
            context.term()


async def _serve_replay(router: zmq.asyncio.Socket, buffer: list[list[bytes]]) -> None:
    while True:
        identity, empty, start = await router.recv_multipart()
        for topic, seq, payload in buffer:
            if int.from_bytes(seq, "big") >= int.from_bytes(start, "big"):
                await router.send_multipart([identity, empty, topic, seq, payload])
        await router.send_multipart([identity, empty, b"", (-1).to_bytes(8, "big", signed=True), b""])


def holds(followed: Followed, blocks: int) -> bool:
    return followed.index.matched(lora_keys(), URL) == blocks


async def test_captured_events_reach_the_index_and_a_bad_message_is_skipped() -> None:
    frames = captured("map_frames.json")
    async with following() as f:
        await f.publisher.send([b"kv", b"\x00", b"not a sequence"])  # malformed: counted, skipped
        for message in frames[:3]:
            await f.publisher.send(message)
        await eventually(lambda: holds(f, 3), "the LoRA blocks are in the replica's view")
        assert f.count("kvgate_kv_events_malformed_total") == 1
        assert f.count("kvgate_kv_events_total", kind="BlockStored") == 3
        assert f.count("kvgate_kv_event_gaps_total") == 0
        status = kv_event_fields(f.metrics.registry.collect())[URL]  # /kvgate/status shows them per replica
        assert (status["events"], status["malformed"], status["gaps"]) == (3, 1, 0)
        # the next batch after /reset_prefix_cache opens with AllBlocksCleared (seq 3 was skipped: a gap,
        # no replay socket: the view is emptied, then learns what seq 4 stored)
        await f.publisher.send(frames[4])
        await eventually(lambda: f.count("kvgate_kv_event_gaps_total") == 1, "the gap is seen")
        await eventually(lambda: f.index.blocks(URL) == 3, "the view holds what seq 4 stored")
        assert holds(f, 0)
        assert f.count("kvgate_kv_event_replays_total", outcome="no-replay-endpoint") == 1


async def test_a_token_id_over_64_bits_is_one_malformed_event_and_the_stream_goes_on() -> None:
    """A BlockStored whose token id is 2^63 (msgpack carries up to 2^64 - 1) is skipped and counted, with
    the good event beside it applied; the view is kept and the next batch is applied too."""
    frames = captured("map_frames.json")
    bad = {"type": "BlockStored", "block_hashes": [99], "parent_block_hash": None,
           "token_ids": [1 << 63, 7], "block_size": 2}  # fmt: skip
    good = {"type": "BlockStored", "block_hashes": [98], "parent_block_hash": None,
            "token_ids": [5, 7], "block_size": 2}  # fmt: skip
    async with following() as f:
        for message in frames[:3]:
            await f.publisher.send(message)
        await eventually(lambda: holds(f, 3), "learned")
        ts = decode_message(frames[2]).ts  # stamped as the replica stamped its batches then
        await f.publisher.send([b"kv", (3).to_bytes(8, "big"), msgpack.packb([ts, [bad, good], 0])])
        await eventually(lambda: f.count("kvgate_kv_events_malformed_total") == 1, "the event is counted")
        assert f.count("kvgate_kv_events_total", kind="BlockStored") == 4, "its neighbour is applied"
        await f.publisher.send(frames[4])  # seq 4: the stream goes on, no gap, no reset
        await eventually(lambda: f.count("kvgate_kv_events_total", kind="BlockStored") == 5, "seq 4")
        assert f.count("kvgate_kv_view_resets_total", reason="stream lost") == 0
        assert f.count("kvgate_kv_event_gaps_total") == 0
        assert f.follower.health()["state"] == "following"
        assert "last_error" not in f.follower.health()


async def test_a_gap_is_repaired_through_the_replay_socket() -> None:
    frames = captured("map_frames.json")
    async with following(replay=frames) as f:
        await f.publisher.send(frames[0])
        await eventually(lambda: f.index.blocks(URL) == 3, "seq 0 applied")
        await f.publisher.send(frames[3])  # seq 1 and 2 (the LoRA blocks) missed: replayed
        await eventually(lambda: holds(f, 3), "the replayed LoRA blocks are in the view")
        assert f.count("kvgate_kv_event_replays_total", outcome="repaired") == 1
        assert f.index.blocks(URL) == 12


async def test_a_sequence_going_back_or_a_restart_empties_the_view() -> None:
    frames = captured("map_frames.json")
    async with following() as f:
        for message in frames[:3]:
            await f.publisher.send(message)
        await eventually(lambda: holds(f, 3), "learned")
        await f.publisher.send(frames[0])  # seq 0 again: the publisher restarted
        await eventually(
            lambda: f.count("kvgate_kv_view_resets_total", reason="publisher restarted") == 1, "reset"
        )
        assert holds(f, 0)
        assert f.index.blocks(URL) == 3
        await f.publisher.send(frames[1])
        await f.publisher.send(frames[2])
        await eventually(lambda: holds(f, 3), "learned again")
        f.replica.restarted("test")  # kvgate saw the replica restart
        await eventually(lambda: f.index.blocks(URL) == 0, "the view is emptied on a restart")
        assert f.count("kvgate_kv_view_resets_total", reason="replica restarted") == 1


@dataclass
class Sources:
    """A replica's ``/kv_event_sources``, served in-process: the next ``answers`` first (failures), then
    the real publisher at ``port`` (``*``: the replica's own host)."""

    port: int
    answers: list[web.Response]

    async def handle(self, request: web.Request) -> web.Response:
        if self.answers:
            return self.answers.pop(0)
        return web.json_response(sources_answer(f"tcp://*:{self.port}"))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kv_event_sources", self.handle)
        return app


@asynccontextmanager
async def publisher(
    endpoint: str | None = None,
) -> AsyncIterator[tuple[zmq.asyncio.Context, zmq.asyncio.Socket]]:
    """A real XPUB socket (bound to ``endpoint``, else to a free port on 127.0.0.1) and its context."""
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint or f"tcp://127.0.0.1:{free_port()}")
    try:
        yield context, pub
    finally:
        pub.close()
        context.term()


def port_of(pub: zmq.asyncio.Socket) -> int:
    return int(pub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])


def follower_errors(metrics: Metrics, url: str) -> float:
    return metrics.registry.get_sample_value("kvgate_kv_event_follower_errors_total", {"replica": url}) or 0.0


async def test_a_replica_without_event_sources_is_retried_until_it_has_them() -> None:
    """A replica that publishes no events (no route: 404; no sources: ``{}``) is no failure: it is
    ``unavailable`` with the reason and asked again after ``recheck``; an answer with events off is a
    failure, counted, and the supervisor starts the next attempt, which follows the publisher once
    /kv_event_sources names it."""
    index, metrics = PreciseIndex(100), Metrics()
    async with publisher() as (context, pub):
        sources = Sources(
            port_of(pub),
            [
                web.Response(status=404),
                web.json_response({}),
                web.json_response({"0": {"enable_kv_cache_events": False}}),
            ],
        )
        async with running(sources.app()) as url, aiohttp.ClientSession() as session:
            follower = KvFollower(Replica(url), index, session, metrics, context, recheck=1.0)
            async with Supervisor().run("kv-events:r0", follower.run, period=PERIOD_S, required=False):
                await eventually(lambda: bool(follower.absent), "no events, said")
                state, why = follower.state()  # the 404's reason, or (a second later) the empty answer's
                assert state == "unavailable"
                assert why.endswith(
                    ("(a server that publishes no KV events)", "(start it with --kv-events-config)")
                )
                await eventually(lambda: bool(follower.health().get("last_error")), "a failure on /healthz")
                assert follower.health()["state"] == "unavailable"
                assert await pub.poll(20_000), "the follower subscribed in the end"
                assert await pub.recv() == b"\x01kv"
                assert follower_errors(metrics, url) == 1, "the answer with events off, only"
                assert follower.health()["last_batch_s_ago"] is None  # nothing received yet
                await pub.send_multipart(captured("map_frames.json")[0])
                await eventually(lambda: index.blocks(url) == 3, "the base blocks are learned")
                health = follower.health()
                assert (health["state"], health["blocks"], "last_error" in health) == ("following", 3, False)
                assert isinstance(health["last_batch_s_ago"], float)


async def test_a_follower_whose_publisher_fails_is_restarted_by_the_supervisor_and_counted() -> None:
    """The replica's event publisher fails (its /kv_event_sources answers 500, five times): each attempt
    fails, and the supervisor, not the follower, restarts it with its backoff. Every failure is counted
    (the supervisor's restarts, the follower's own counter) and shown where /healthz shows the background
    tasks; past the failure limit the task is failing on /healthz but never fails readiness (the
    predicted index routes meanwhile). Once the publisher is up, the next attempt follows it, and after
    a period of following the burst is over."""
    index, metrics = PreciseIndex(100), Metrics()
    supervisor = Supervisor(failure_limit=1.0)
    period = 0.3  # failing past the limit within a second, a burst ended in 0.3 s of following
    async with publisher() as (context, pub):
        sources = Sources(port_of(pub), [web.Response(status=500, text="publisher failed") for _ in range(5)])
        async with running(sources.app()) as url, aiohttp.ClientSession() as session:
            follower = KvFollower(Replica(url), index, session, metrics, context)
            name = "kv-events:r0"
            async with supervisor.run(name, follower.run, period=period, required=False) as task:
                await eventually(
                    lambda: task.restarts >= 2 and task.failing_for(time.monotonic()) > period,
                    "restarted, and failing past the limit",
                )
                assert (supervisor.failing(), supervisor.failing_tasks()) == ([], []), "never unready"
                shown = supervisor.health()[name]  # what /healthz's detail view shows under background
                assert shown["last_error"] == {
                    "type": "MalformedEvent",
                    "message": f"{url}/kv_event_sources answered 500",
                }
                assert shown["failing_for_s"] is not None
                assert await pub.poll(20_000), "the next attempt after the failures subscribed"
                assert await pub.recv() == b"\x01kv"
                assert supervisor.restart_counts() == {name: 5}
                assert follower_errors(metrics, url) == 5
                await pub.send_multipart(captured("map_frames.json")[0])
                await eventually(lambda: index.blocks(url) == 3, "its events are learned")
                await eventually(
                    lambda: supervisor.health()[name]["failing_for_s"] is None, "the burst is over"
                )
                assert task.backoff.failures == 0, "the backoff starts over"
                assert "last_error" not in follower.health()


@pytest.mark.parametrize("where", ["another-host", "ipc"])
async def test_a_replica_that_names_a_publisher_elsewhere_is_never_followed_there(
    where: str, tmp_path: Path
) -> None:
    """The replica (127.0.0.1) names a live publisher on 127.0.0.2, or an ``ipc://`` path on kvgate's
    host: the follower refuses it with a clear ``last_error``, is restarted, and never subscribes there."""
    endpoint = f"tcp://127.0.0.2:{free_port()}" if where == "another-host" else f"ipc://{tmp_path}/pub"

    async def sources(request: web.Request) -> web.Response:
        return web.json_response(sources_answer(endpoint))

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    metrics = Metrics()
    async with (
        publisher(endpoint) as (context, pub),
        running(app) as url,
        aiohttp.ClientSession() as session,
    ):
        follower = KvFollower(Replica(url), PreciseIndex(100), session, metrics, context)
        async with Supervisor().run("kv-events:r0", follower.run, period=PERIOD_S, required=False):
            await eventually(
                lambda: follower_errors(metrics, url) >= 2,
                "refused, and refused again on the restart",
                within=15,
            )
            health = follower.health()
            assert health["state"] == "unavailable"
            assert "only tcp:// on the replica's own host (127.0.0.1) is followed" in str(
                health["last_error"]
            )
            assert str(health["last_error"]).startswith(f"MalformedEvent: refused {endpoint[:60]!r}")
            assert not await pub.poll(100), "nothing ever subscribed to the publisher it named"
