"""Follow each replica's KV cache events (vLLM ``--kv-events-config``, ZMQ + msgpack) into the precise index.

One ``KvFollower`` per replica, each a supervised task (``kv-events:<replica id>``): each ``run()`` is one
attempt, and the supervisor restarts a failed one with its backoff (``tasks.supervisor``). It finds the
replica's publishers from ``GET /kv_event_sources`` (a replica that names none, or has no such route,
publishes no events: no failure, it is asked again every ``recheck`` and when it restarts), one per
data-parallel rank (``kv.sources``: both
answer shapes, a malformed entry skipped and counted, only the replica's own host followed; an explicit
endpoint in the settings overrides it and may be anywhere), subscribes to every rank's, and applies each
rank's batches to that rank's view of the replica (``kv.index``: the replica holds what any of its ranks
holds). Messages are decoded one at a time at the boundary (``kv.events``): a malformed one is counted and
skipped. Sequence numbers are checked per rank: a gap is repaired through the rank's replay socket when
there is one, else that rank's view is emptied and re-learned from what follows; a sequence that goes
back means the publisher restarted (its view is emptied too), and so does a rank whose publisher
disconnects (ZMQ's socket monitor; its events meanwhile are lost). The whole view is emptied when kvgate
sees the replica restart (its ``incarnation`` moves), when an attempt that was following fails, and when
kvgate purges the replica's cache itself (``cleared``): vLLM reports ``AllBlocksCleared`` only with the
next engine step, so a purge must not wait for it. Any other failure ends the attempt: counted per replica
(``kvgate_kv_event_follower_errors_total``, ``last_error``), and by the supervisor, which logs it, shows it
on ``/healthz`` (``background``) and starts the next attempt (discovery again, fresh subscriptions) after
its backoff. Whether a replica's events are followed is its ``state()`` (``STATES``), on ``/healthz`` with
its reason and in ``kvgate_kv_events_state{replica,state}``. A follower that keeps failing never fails
readiness: meanwhile the predicted index routes that replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.core.errors import KvgateError, MalformedEvent
from gateway.core.wire import replica_id
from gateway.fleet.backends import answers
from gateway.fleet.replicas import Replica
from gateway.kv.events import Batch, decode_message, peek_ts, sequence
from gateway.kv.index import PreciseIndex
from gateway.kv.sources import SOURCES_PATH, Endpoints, Sources, parse_endpoint_setting, parse_sources
from gateway.tasks.supervisor import Supervisor, raise_if_cancelling
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

POLL_MS = 500  # how often the loop looks up from its sockets (a replica restart, a cancellation)
REPLAY_TIMEOUT_S = 2.0
REPLICA_ERRORS = (KvgateError, aiohttp.ClientError, OSError)  # a replica's fault: logged without a traceback
PERIOD_S = 30.0  # the supervisor's period: an attempt that lasts this long works; restarts wait at most this
_END_SEQ = -1
MAX_LAG_S = 5.0  # a batch older than this when it arrives: the rank is lagging (its view emptied, dropped)
RESUME_LAG_S = MAX_LAG_S / 2  # a lagging rank applies batches again from one this fresh
STATES = ("following", "partial", "lost", "unavailable", "lagging")
"""A replica's KV events on ``/healthz`` and in ``kvgate_kv_events_state``: every rank followed; some
(the others lost, not reachable, or their entries skipped); none, after following (the stream was lost:
the views are emptied); none (no sources, a bad answer, no publisher answering); a rank behind by more
than ``MAX_LAG_S`` (its view emptied, its batches dropped unread until one arrives within
``RESUME_LAG_S``: the index never claims what the replica may have evicted meanwhile)."""
ROUTING = {"following": "exact", "partial": "degraded", "lost": "predicted", "unavailable": "predicted",
           "lagging": "predicted"}  # fmt: skip
"""How far routing can trust a replica's view, by its state (after vllm-project/router RFC #294): every
rank's blocks; some ranks' only (the others' prefixes are missed, never claimed); none (the predicted
index routes it)."""
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


@dataclass(slots=True)
class _Stream:
    """One data-parallel rank's publisher, its subscription and where its sequence is."""

    rank: int
    endpoints: Endpoints
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    state: str = "connecting"  # connecting | following | lost | lagging
    reason: str = "no answer from its publisher yet"
    expected: int | None = None  # the next sequence number; None until a batch arrived
    offset: float | None = None  # the least (arrival - batch ts) seen: the clocks' skew, no queueing


class KvFollower:
    """One replica's KV events (every data-parallel rank's), applied to its view in ``index``."""

    def __init__(
        self,
        replica: Replica,
        index: PreciseIndex,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        context: zmq.asyncio.Context,
        *,
        endpoints: Sequence[Endpoints] = (),
        clock: Callable[[], float] = time.time,
        recheck: float = PERIOD_S,
    ) -> None:
        self.replica = replica
        self.index = index
        self.session = session
        self.metrics = metrics
        self.context = context
        self.configured = Sources(dict(enumerate(endpoints))) if endpoints else None  # ranks 0, 1, ...
        self.clock = clock
        self.recheck = recheck  # seconds between asking a replica that publishes no events again
        self.streams: dict[int, _Stream] = {}  # by rank, while an attempt follows them
        self.skipped: tuple[str, ...] = ()  # the last answer's entries left out, and why
        self.incarnation = replica.incarnation
        self.lost = ""  # why the last attempt, which had followed, ended ("" once another starts)
        self.last_batch: float | None = None  # monotonic time of the last batch applied
        self.last_error = ""
        self.absent = ""  # why the replica has no events to follow (it names no publisher), while so
        self.lag: float | None = None  # how late the last batch arrived (``_lagging``: skew taken out)
        self.dropped = 0  # batches dropped unread while a rank lagged

    def state(self) -> tuple[str, str]:
        """One of ``STATES`` and why (empty when every rank is followed)."""
        if not self.streams:
            if self.lost:
                return "lost", self.lost
            return "unavailable", self.last_error or self.absent or "not discovered yet"
        behind = [f"rank {s.rank}: {s.reason}" for s in self.streams.values() if s.state != "following"]
        why = "; ".join([*behind, *(f"skipped a source: {reason}" for reason in self.skipped)])
        following = len(self.streams) - len(behind)
        if any(s.state == "lagging" for s in self.streams.values()):
            return "lagging", why
        if following and not why:
            return "following", ""
        if following:
            return "partial", why
        lost = any(s.state == "lost" for s in self.streams.values())
        return ("lost" if lost else "unavailable"), why

    def settled(self) -> bool:
        """Whether its state will not move by itself soon: every rank followed, a failure seen, the
        stream lost, or no events published (the start line waits for it: ``kv.trust.announce``)."""
        return self.state()[0] == "following" or bool(self.last_error or self.lost or self.absent)

    def health(self) -> dict[str, object]:
        """For ``/healthz`` (through the KV indexer's record of the replica): the state of the replica's
        events and why, the routing trust they give (``ROUTING``; each worker's ``kv.trust`` adds its
        tokenizer and live check), each rank's state, how long since the last batch, how late the last
        one arrived, the batches dropped while it lagged, the blocks its view holds, the last failure and
        whether it is ``settled``. Informational: a replica without a view is routed by the predicted
        index, never by a stale view (a lost stream's view is emptied)."""
        state, reason = self.state()
        since = None if self.last_batch is None else round(time.monotonic() - self.last_batch, 1)
        return {
            "state": state,
            "routing": ROUTING[state],
            **({"reason": reason} if reason else {}),
            "ranks": {str(s.rank): s.state for s in self.streams.values()},
            "last_batch_s_ago": since,
            "lag_s": None if self.lag is None else round(self.lag, 3),
            "dropped_batches": self.dropped,
            "blocks": self.index.blocks(self.replica.url),
            **({"last_error": self.last_error} if self.last_error else {}),
            "settled": self.settled(),
        }

    def cleared(self, reason: str, rank: int | None = None) -> None:
        """Empty this replica's view, or one rank's (it restarted, was purged, or events were lost)."""
        self.index.clear(self.replica.url, rank)
        self.metrics.kv_view_resets.labels(self.replica.url, reason).inc()

    async def run(self) -> None:
        """One attempt: find the publishers, subscribe to each, follow until cancelled. A failure is
        recorded (counted, ``last_error``), empties the view (events may have been missed meanwhile) and
        is raised for the supervisor, which starts the next attempt."""
        try:
            await self._follow()
        except Exception as exc:  # a cancellation (BaseException) just ends the attempt
            raise_if_cancelling(exc)
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            self.metrics.kv_event_errors.labels(self.replica.url).inc()
            self.lost = ""
            if any(s.state == "following" for s in self.streams.values()):
                self.lost = f"stream lost: {self.last_error}"
                self.cleared("stream lost")
            raise
        finally:
            self.streams = {}

    async def _follow(self) -> None:
        sources = self.configured or await self._discover()
        while sources is None:  # it publishes none: no failure, asked again now and then (or on a restart)
            await self._wait_for_events()
            sources = await self._discover()
        self.absent = ""
        self.skipped, self.lost = sources.skipped, ""
        poller = zmq.asyncio.Poller()
        try:
            for rank, endpoints in sources.ranks.items():
                socket = self.context.socket(zmq.SUB)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SUBSCRIBE, endpoints.topic.encode())
                monitor = socket.get_monitor_socket(_MONITORED)
                self.streams[rank] = stream = _Stream(rank, endpoints, socket, monitor)
                socket.connect(endpoints.publisher)
                poller.register(socket, zmq.POLLIN)
                poller.register(monitor, zmq.POLLIN)
            log.info("following KV events of %s at %s", self.replica.url,
                     ", ".join(s.endpoints.publisher for s in self.streams.values()))  # fmt: skip
            while True:
                self._check_restart()
                ready = dict(await poller.poll(POLL_MS))
                for stream in list(self.streams.values()):
                    if stream.monitor in ready:
                        self._watch(stream, await stream.monitor.recv_multipart())
                    if stream.socket in ready:
                        await self.receive(await stream.socket.recv_multipart(), stream.rank)
        finally:
            for stream in self.streams.values():
                stream.socket.disable_monitor()
                stream.monitor.close()
                stream.socket.close()

    def _watch(self, stream: _Stream, frames: list[bytes]) -> None:
        """A connection event of one rank's subscription: connected (followed), disconnected (its view
        is emptied: what it published meanwhile is lost), or a connect attempt that got no answer."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            stream.state, stream.reason = "following", ""
        elif event == zmq.EVENT_DISCONNECTED and stream.state == "following":
            stream.state, stream.reason = "lost", "its publisher disconnected (view emptied)"
            stream.expected = None
            log.warning("KV events of %s, rank %d: publisher disconnected", self.replica.url, stream.rank)
            self.cleared("stream lost", stream.rank)
        elif event == zmq.EVENT_CONNECT_RETRIED and stream.state == "connecting":
            stream.reason = f"no answer from {stream.endpoints.publisher}"

    def _check_restart(self) -> None:
        if self.replica.incarnation != self.incarnation:
            self.incarnation = self.replica.incarnation
            self.cleared("replica restarted")
            for stream in self.streams.values():
                stream.expected = None

    async def _wait_for_events(self) -> None:
        """``recheck`` seconds, or until kvgate sees the replica restart (it may publish events now)."""
        step = min(POLL_MS / 1000, self.recheck)
        for _ in range(max(1, round(self.recheck / step))):
            await asyncio.sleep(step)
            if self.replica.incarnation != self.incarnation:
                break
        self.incarnation = self.replica.incarnation

    async def _discover(self) -> Sources | None:
        """The replica's publishers; None when it publishes none (its answer is empty, as vLLM's without
        ``--kv-events-config``, or it has no such route): not a failure, the predicted index routes it."""
        url = self.replica.url
        async with self.session.get(url + SOURCES_PATH) as response:
            if response.status == 404:
                self.absent = f"{url} has no {SOURCES_PATH} (a server that publishes no KV events)"
                return None
            if response.status != 200:
                raise MalformedEvent(f"{url}{SOURCES_PATH} answered {response.status}")
            answer = answers.json_of(await response.read())  # MalformedAnswer: not UTF-8 JSON
        if answer in ({}, [], {"sources": []}):
            self.absent = f"{url} publishes no KV events (start it with --kv-events-config)"
            return None
        sources = parse_sources(answer, self.replica.url)
        if sources.skipped:
            self.metrics.kv_event_sources_skipped.labels(self.replica.url).inc(len(sources.skipped))
            log.warning("KV event sources of %s: skipped %d: %s", self.replica.url, len(sources.skipped),
                        "; ".join(sources.skipped[:3]))  # fmt: skip
        return sources

    async def receive(self, frames: list[bytes], rank: int = 0) -> None:
        """One message from a rank's publisher: decoded, checked against its sequence, applied; or, while
        the rank lags (``MAX_LAG_S``), dropped unread."""
        url = self.replica.url
        if self._lagging(frames, rank):
            return
        try:
            batch = decode_message(frames, native=True)
        except MalformedEvent as exc:
            self.metrics.kv_event_malformed.labels(url).inc()
            log.warning("KV events of %s: skipped a malformed message: %s", url, exc.message)
            return
        stream = self.streams.get(rank)
        expected = None if stream is None else stream.expected
        if stream is not None and expected is not None and batch.seq != expected:
            self.metrics.kv_event_gaps.labels(url).inc()
            if batch.seq < expected or not await self._replay(stream, expected, batch.seq):
                reason = "publisher restarted" if batch.seq < expected else "events lost"
                log.warning("KV events of %s, rank %d: expected %d, got %d: %s", url, rank, expected,
                            batch.seq, reason)  # fmt: skip
                self.cleared(reason, rank)
        self._apply(batch, rank)

    def _lagging(self, frames: list[bytes], rank: int) -> bool:
        """Whether this message is dropped: its rank lags. Its lag is how much later than the freshest
        batch of the stream it arrives (arrival minus the batch's time, less the least such difference
        seen since subscribing: the replica's clock skew cancels out, queueing stays). A batch that lags
        by more than ``MAX_LAG_S`` empties the
        rank's view (what the replica evicted meanwhile must not be claimed) and starts dropping; the
        first one within ``RESUME_LAG_S`` is applied again (its chains' earlier blocks are then unknown,
        so they are learned from what follows, never claimed). Dropped batches are counted."""
        stream = self.streams.get(rank)
        if stream is None or len(frames) != 3:
            return False
        ts = peek_ts(bytes(frames[2]))
        if ts is None:
            return False
        with contextlib.suppress(MalformedEvent):
            if stream.expected is not None and sequence(bytes(frames[1])) < stream.expected:
                stream.offset = None  # the publisher restarted: its clock's offset is learned again
        age = self.clock() - ts
        stream.offset = age if stream.offset is None else min(stream.offset, age)
        self.lag = lag = age - stream.offset
        if stream.state == "lagging" and lag <= RESUME_LAG_S:
            stream.state, stream.reason = "following", ""
            log.info("KV events of %s, rank %d: caught up (%.1f s behind)", self.replica.url, rank, lag)
            return False
        if stream.state != "lagging" and lag <= MAX_LAG_S:
            return False
        if stream.state != "lagging":
            stream.state = "lagging"
            log.warning("KV events of %s, rank %d: %.1f s behind: view emptied, batches dropped until it "
                        "catches up", self.replica.url, rank, lag)  # fmt: skip
            self.cleared("lagging", rank)
        stream.reason = f"{lag:.1f} s behind (over {MAX_LAG_S:g} s): view emptied, batches dropped"
        with contextlib.suppress(MalformedEvent):
            stream.expected = sequence(bytes(frames[1])) + 1
        self.dropped += 1
        self.metrics.kv_event_dropped.labels(self.replica.url).inc()
        return True

    def _apply(self, batch: Batch, rank: int) -> None:
        url = self.replica.url
        if batch.malformed:
            self.metrics.kv_event_malformed.labels(url).inc(batch.malformed)
            log.warning(
                "KV events of %s: skipped %d malformed events: %s", url, batch.malformed, batch.errors
            )
        for kind, count in batch.kinds().items():
            self.metrics.kv_events.labels(url, kind).inc(count)
        self.metrics.kv_event_batches.labels(url, "python" if batch.native is None else "c").inc()
        self.index.apply_batch(url, batch, rank)
        self.metrics.kv_event_lag.labels(url).set(max(0.0, self.clock() - batch.ts))
        stream = self.streams.get(rank)
        if stream is not None:
            stream.expected = batch.seq + 1
            if stream.state != "lagging":  # a batch arrived: connected, whatever was seen
                stream.state, stream.reason = "following", ""
        self.last_batch, self.last_error = time.monotonic(), ""

    async def _replay(self, stream: _Stream, start: int, stop: int) -> bool:
        """Batches ``start`` .. ``stop - 1`` of one rank from its replay socket, applied in order; False
        when there is no replay socket or it could not give them all (that rank's view is re-learned)."""
        url = self.replica.url
        if stream.endpoints.replay is None:
            self.metrics.kv_event_replays.labels(url, "no-replay-endpoint").inc()
            return False
        socket = self.context.socket(zmq.DEALER)
        got: list[Batch] = []
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(stream.endpoints.replay)
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = asyncio.get_running_loop().time() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or not await socket.poll(int(left * 1000)):
                    self.metrics.kv_event_replays.labels(url, "timeout").inc()
                    return False
                reply = await socket.recv_multipart()
                if len(reply) != 4:
                    raise MalformedEvent(f"a replay reply has 4 frames, got {len(reply)}")
                if sequence(reply[2]) == _END_SEQ:
                    break
                batch = decode_message(reply[1:], native=True)
                if start <= batch.seq < stop:
                    got.append(batch)
        except MalformedEvent as exc:
            log.warning("KV events of %s: replay failed: %s", url, exc.message)
            self.metrics.kv_event_replays.labels(url, "malformed").inc()
            return False
        finally:
            socket.close()
        if [b.seq for b in got] != list(range(start, stop)):
            self.metrics.kv_event_replays.labels(url, "incomplete").inc()
            return False
        for batch in got:
            self._apply(batch, stream.rank)
        self.metrics.kv_event_replays.labels(url, "repaired").inc()
        return True


def in_state(follower: KvFollower, state: str) -> float:
    """1 when the replica's KV events are in ``state``, else 0 (``kvgate_kv_events_state``)."""
    return 1.0 if follower.state()[0] == state else 0.0


@contextlib.asynccontextmanager
async def follow_events(
    endpoint_settings: list[str],
    replicas: Sequence[Replica],
    session: aiohttp.ClientSession,
    index: PreciseIndex,
    metrics: Metrics,
    supervisor: Supervisor,
) -> AsyncIterator[dict[str, KvFollower]]:
    """One follower per replica, each a supervised background task (``kv-events:<replica id>``: task
    names are on anonymous /healthz, a URL never is; not required: a replica's events failing never
    fails readiness) while the block runs. They run in the KV indexer (``kv.indexer``), one process
    per kvgate."""
    configured: dict[str, list[Endpoints]] = {}  # a replica's entries, in order: its ranks 0, 1, ...
    for url, endpoints in map(parse_endpoint_setting, endpoint_settings):
        configured.setdefault(url, []).append(endpoints)
    context = zmq.asyncio.Context()
    followers = {
        r.url: KvFollower(r, index, session, metrics, context, endpoints=configured.get(r.url, ()))
        for r in replicas
    }
    for url, follower in followers.items():
        metrics.kv_view_blocks.labels(url).set_function(functools.partial(index.blocks, url))
        for state in STATES:
            metrics.kv_events_state.labels(url, state).set_function(
                functools.partial(in_state, follower, state)
            )
    try:
        async with contextlib.AsyncExitStack() as stack:
            for url, follower in followers.items():
                task = supervisor.run(
                    f"kv-events:{replica_id(url)}", follower.run,
                    period=PERIOD_S, required=False, expected=REPLICA_ERRORS,
                )  # fmt: skip
                await stack.enter_async_context(task)
            yield followers
    finally:
        context.destroy(linger=0)
