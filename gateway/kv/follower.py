"""Follow each replica's KV cache events (vLLM ``--kv-events-config``, ZMQ + msgpack) into the precise index.

One ``KvFollower`` per replica, each a supervised task (``kv-events:<replica id>``): each ``run()`` is one
attempt, and the supervisor restarts a failed one with its backoff (``tasks.supervisor``). It finds the
replica's publisher from ``GET /kv_event_sources`` (``*`` or ``0.0.0.0`` in vLLM's endpoint means the
replica's own host; an endpoint on any other host, or not ``tcp://``, is refused and never connected; an
explicit endpoint in the settings overrides it and may be anywhere), subscribes, and applies each batch to
that replica's view (``kv.index``). Messages are decoded one at a time at the boundary (``kv.events``): a
malformed one is counted and skipped. Sequence numbers are checked: a gap is repaired through vLLM's replay
socket when there is one, else the replica's view is emptied and re-learned from what follows; a sequence
that goes back means the publisher restarted (the view is emptied too). The view is also emptied when kvgate
sees the replica restart (its ``incarnation`` moves), when the follower loses the stream, and when kvgate
purges the replica's cache itself (``cleared``): vLLM reports ``AllBlocksCleared`` only with the next engine
step, so a purge must not wait for it. Any other failure ends the attempt: counted per replica
(``kvgate_kv_event_follower_errors_total``, ``last_error``), and by the supervisor, which logs it, shows it
on ``/healthz`` (``background``) and starts the next attempt (discovery again, a fresh subscription) after
its backoff. A follower that keeps failing never fails readiness: meanwhile the predicted index routes that
replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio

from gateway.core.errors import KvgateError, MalformedEvent
from gateway.core.wire import replica_id
from gateway.fleet.backends import answers
from gateway.fleet.invalidation import PurgeAll
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.kv.events import Batch, decode_message, sequence
from gateway.kv.index import PreciseIndex
from gateway.kv.prompt_tokens import PromptTokens
from gateway.tasks.supervisor import Supervisor, raise_if_cancelling
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

SOURCES_PATH = "/kv_event_sources"
POLL_MS = 500  # how often the loop looks up from the socket (a replica restart, a cancellation)
REPLAY_TIMEOUT_S = 2.0
REPLICA_ERRORS = (KvgateError, aiohttp.ClientError, OSError)  # a replica's fault: logged without a traceback
PERIOD_S = 30.0  # the supervisor's period: an attempt that lasts this long works; restarts wait at most this
_END_SEQ = -1


@dataclass(frozen=True, slots=True)
class Endpoints:
    publisher: str
    replay: str | None = None
    topic: str = ""


def endpoints_from_sources(sources: object, replica_url: str) -> Endpoints:
    """The publisher of data-parallel rank 0 from vLLM's ``/kv_event_sources`` answer, with a wildcard
    host replaced by the replica's own. Only a ``tcp://`` endpoint on the replica's own host is
    followed: any other (another host, an ``ipc://`` path on kvgate's host) is a ``MalformedEvent``,
    never connected; ``kv_event_endpoints`` names a publisher elsewhere."""
    if not isinstance(sources, dict) or not sources:
        raise MalformedEvent(f"{SOURCES_PATH} answered no event sources")
    config = sources.get("0", next(iter(sources.values())))
    if not isinstance(config, dict) or config.get("enable_kv_cache_events") is not True:
        raise MalformedEvent(f"{replica_url} does not publish KV events (start it with --kv-events-config)")
    if config.get("publisher") != "zmq" or not isinstance(config.get("endpoint"), str):
        raise MalformedEvent(f"{replica_url} publishes KV events with {config.get('publisher')!r}, not zmq")
    replay = config.get("replay_endpoint")
    topic = config.get("topic") or ""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    return Endpoints(
        _own_host(config["endpoint"], host),
        _own_host(replay, host) if isinstance(replay, str) and replay else None,
        topic if isinstance(topic, str) else "",
    )


def _own_host(endpoint: str, host: str) -> str:
    """``tcp://ADDRESS:PORT`` with ADDRESS the replica's host or a wildcard (made the replica's host)."""
    scheme, sep, rest = endpoint.partition("://")
    address, _, port = rest.rpartition(":")
    if address in ("*", "0.0.0.0", "[::]", "::"):
        address = host
    if scheme != "tcp" or not sep or address.strip("[]").lower() != host.lower() or not _is_port(port):
        raise MalformedEvent(
            f"refused {endpoint[:60]!r} from {SOURCES_PATH}: only tcp:// on the replica's own host "
            f"({host}) is followed, or an endpoint set in kv_event_endpoints"
        )
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


def parse_endpoint_setting(entry: str) -> tuple[str, Endpoints]:
    """``REPLICA_URL=PUB_ENDPOINT[|REPLAY_ENDPOINT]`` (the ``kv_event_endpoints`` setting)."""
    url, sep, rest = entry.partition("=")
    publisher, _, replay = rest.partition("|")
    if not sep or not url or not publisher.startswith(("tcp://", "ipc://")):
        raise ValueError(
            f"kv_event_endpoints entries are REPLICA_URL=tcp://HOST:PORT[|REPLAY], not {entry!r}"
        )
    return url.strip().rstrip("/"), Endpoints(publisher.strip(), replay.strip() or None)


class KvFollower:
    """One replica's KV events, applied to its view in ``index``."""

    def __init__(
        self,
        replica: Replica,
        index: PreciseIndex,
        session: aiohttp.ClientSession,
        metrics: Metrics,
        context: zmq.asyncio.Context,
        *,
        endpoints: Endpoints | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica = replica
        self.index = index
        self.session = session
        self.metrics = metrics
        self.context = context
        self.configured = endpoints
        self.clock = clock
        self.endpoints: Endpoints | None = None
        self.expected: int | None = None  # the next sequence number; None until a batch arrived
        self.incarnation = replica.incarnation
        self.connected = False
        self.last_batch: float | None = None  # monotonic time of the last batch applied
        self.last_error = ""

    def health(self) -> dict[str, object]:
        """For ``/healthz``: whether the stream is followed, how long since its last batch, the blocks its
        view holds, and the last failure. Informational: a replica without a view is routed by the
        predicted index, never by a stale view (the view is emptied when its stream is lost)."""
        since = None if self.last_batch is None else round(time.monotonic() - self.last_batch, 1)
        return {
            "following": self.connected,
            "last_batch_s_ago": since,
            "blocks": self.index.blocks(self.replica.url),
            **({"last_error": self.last_error} if self.last_error else {}),
        }

    def cleared(self, reason: str) -> None:
        """Empty this replica's view (it restarted, was purged, or events were lost)."""
        self.index.clear(self.replica.url)
        self.metrics.kv_view_resets.labels(self.replica.url, reason).inc()

    async def run(self) -> None:
        """One attempt: find the publisher, subscribe, follow until cancelled. A failure is recorded
        (counted, ``last_error``), empties the view (events may have been missed meanwhile) and is raised
        for the supervisor, which starts the next attempt."""
        try:
            await self._follow()
        except Exception as exc:  # a cancellation (BaseException) just ends the attempt
            raise_if_cancelling(exc)
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            self.metrics.kv_event_errors.labels(self.replica.url).inc()
            if self.connected:
                self.cleared("stream lost")
            raise
        finally:
            self.connected = False
            self.expected = None

    async def _follow(self) -> None:
        self.endpoints = self.configured or await self._discover()
        socket = self.context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
            socket.connect(self.endpoints.publisher)
            self.connected = True
            log.info("following KV events of %s at %s", self.replica.url, self.endpoints.publisher)
            while True:
                self._check_restart()
                if await socket.poll(POLL_MS):
                    await self.receive(await socket.recv_multipart())
        finally:
            socket.close()

    def _check_restart(self) -> None:
        if self.replica.incarnation != self.incarnation:
            self.incarnation = self.replica.incarnation
            self.cleared("replica restarted")
            self.expected = None

    async def _discover(self) -> Endpoints:
        async with self.session.get(self.replica.url + SOURCES_PATH) as response:
            if response.status != 200:
                raise MalformedEvent(f"{self.replica.url}{SOURCES_PATH} answered {response.status}")
            sources = answers.json_of(await response.read())  # MalformedAnswer: not UTF-8 JSON
        return endpoints_from_sources(sources, self.replica.url)

    async def receive(self, frames: list[bytes]) -> None:
        """One message from the publisher: decoded, checked against the sequence, applied."""
        url = self.replica.url
        try:
            batch = decode_message(frames)
        except MalformedEvent as exc:
            self.metrics.kv_event_malformed.labels(url).inc()
            log.warning("KV events of %s: skipped a malformed message: %s", url, exc.message)
            return
        expected = self.expected
        if expected is not None and batch.seq != expected:
            self.metrics.kv_event_gaps.labels(url).inc()
            if batch.seq < expected or not await self._replay(expected, batch.seq):
                reason = "publisher restarted" if batch.seq < expected else "events lost"
                log.warning("KV events of %s: expected %d, got %d: %s", url, expected, batch.seq, reason)
                self.cleared(reason)
        self._apply(batch)

    def _apply(self, batch: Batch) -> None:
        url = self.replica.url
        if batch.malformed:
            self.metrics.kv_event_malformed.labels(url).inc(batch.malformed)
            log.warning(
                "KV events of %s: skipped %d malformed events: %s", url, batch.malformed, batch.errors
            )
        kinds: dict[str, int] = {}
        for event in batch.events:
            kind = type(event).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
        for kind, count in kinds.items():
            self.metrics.kv_events.labels(url, kind).inc(count)
        self.index.apply(url, batch.events)
        self.metrics.kv_event_lag.labels(url).set(max(0.0, self.clock() - batch.ts))
        self.expected = batch.seq + 1
        self.last_batch, self.last_error = time.monotonic(), ""

    async def _replay(self, start: int, stop: int) -> bool:
        """Batches ``start`` .. ``stop - 1`` from the replay socket, applied in order; False when there is
        no replay socket or it could not give them all (the view is then re-learned)."""
        url = self.replica.url
        if self.endpoints is None or self.endpoints.replay is None:
            self.metrics.kv_event_replays.labels(url, "no-replay-endpoint").inc()
            return False
        socket = self.context.socket(zmq.DEALER)
        got: list[Batch] = []
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.endpoints.replay)
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
                batch = decode_message(reply[1:])
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
            self._apply(batch)
        self.metrics.kv_event_replays.labels(url, "repaired").inc()
        return True


def followers_health(followers: dict[str, KvFollower], names: dict[str, str]) -> dict[str, object]:
    """Each follower's ``health()`` for ``/healthz``, under the replica's public name (``names``)."""
    return {names[url]: follower.health() for url, follower in followers.items()}


class PreciseSettings(Protocol):
    """The settings ``precise_parts`` reads (``gateway.settings.model.Settings`` has them)."""

    @property
    def kv_events(self) -> bool: ...
    @property
    def precise_index_entries(self) -> int: ...
    @property
    def tokenizer(self) -> Path | None: ...


def precise_parts(settings: PreciseSettings) -> tuple[PreciseIndex | None, PromptTokens | None]:
    """The precise index (``kv_events`` on) and the base model's tokenizer (``tokenizer`` set); a
    tokenizer that cannot be read stops kvgate's start (config fails closed); one whose chat prompts
    cannot be rendered exactly (a template that does not compile, a processor's) is said at start."""
    index = PreciseIndex(settings.precise_index_entries) if settings.kv_events else None
    if settings.tokenizer is None:
        return index, None
    tokens = PromptTokens.from_path(settings.tokenizer)
    if tokens.chat_problem is not None:
        log.warning(
            "chat prompts are routed on the predicted index: kvgate cannot render %s's chat template as "
            "vLLM does (%s); completions are keyed by their tokens",
            settings.tokenizer,
            tokens.chat_problem,
        )
    return index, tokens


@contextlib.asynccontextmanager
async def follow_events(
    endpoint_settings: list[str],
    pool: ReplicaPool,
    index: PreciseIndex | None,
    metrics: Metrics,
    purger: PurgeAll | None,
    supervisor: Supervisor,
) -> AsyncIterator[dict[str, KvFollower]]:
    """One follower per replica, each a supervised background task (``kv-events:<replica id>``: task
    names are on anonymous /healthz, a URL never is; not required: a replica's events failing never
    fails readiness) while the block runs (none when ``kv_events`` is off); a purge kvgate makes
    (purge-all) empties that replica's view at once."""
    if index is None:
        yield {}
        return
    configured = dict(parse_endpoint_setting(entry) for entry in endpoint_settings)
    context = zmq.asyncio.Context()
    followers = {
        r.url: KvFollower(r, index, pool.session, metrics, context, endpoints=configured.get(r.url))
        for r in pool.replicas
    }
    for url in followers:
        metrics.kv_view_blocks.labels(url).set_function(functools.partial(index.blocks, url))
    if purger is not None:
        purger.on_purged = lambda replica: followers[replica.url].cleared("purged by kvgate")
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
