"""A Redis URL to a redis-py asyncio client: one place that knows every kind of Redis kvgate talks to.

    redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]       rediss://... (TLS)      unix://[[USER]:PASSWORD@]/PATH[?db=DB]
        one server, as redis-py's ``Redis.from_url`` reads it (the embedded default is a ``unix://`` URL)
    redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB][?sentinel_password=...]
        the master named MASTER, as the listed sentinels report it (port 26379 by default); the user and
        password are the master's, ``sentinel_username`` / ``sentinel_password`` the sentinels' own
    redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]
        a Redis Cluster, discovered from any of the listed nodes (port 6379 by default; database 0 only)

A Sentinel client finds the current master again after a failover (its connections ask the sentinels
on every reconnect). ``write_acked`` runs a write and then ``WAIT``s, on the same connection of the
server that ran it, for one of that server's replicas to acknowledge it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import NoBackoff

from gateway.core.errors import BadRequest

RedisClient = Redis | RedisCluster
"""What the epoch table runs on: one server (plain or Sentinel-managed) or a Redis Cluster."""

SENTINEL = "redis+sentinel"
CLUSTER = "redis+cluster"
PLAIN = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
REDIS_PORT = 6379
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
HEALTH_CHECK_INTERVAL = 10  # seconds idle before a pooled connection is PINGed on its next use
SENTINEL_TIMEOUT = 1.0  # seconds for one sentinel to answer: a dead one must not hold up finding the master


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``redis+sentinel://`` or ``redis+cluster://`` URL (plain URLs go to redis-py as they are)."""

    scheme: str
    nodes: tuple[tuple[str, int], ...]
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def scheme_of(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise BadRequest(f"redis URL has no scheme: use one of {_schemes()}", param="redis_url")
    return scheme.lower()


def parse_target(url: str) -> RedisTarget:
    """Read a Sentinel or Cluster URL; anything malformed is one clear error (never the password)."""
    scheme = scheme_of(url)
    if scheme not in (SENTINEL, CLUSTER):
        raise BadRequest(
            f"unsupported Redis URL scheme {scheme}://: use one of {_schemes()}", param="redis_url"
        )
    parsed = urlsplit(url)
    if parsed.fragment:
        raise _bad(scheme, "no #fragment")
    userinfo, at, hosts = parsed.netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    nodes = _nodes(scheme, hosts, SENTINEL_PORT if scheme == SENTINEL else REDIS_PORT)
    options = _options(scheme, parsed.query)
    parts = [part for part in parsed.path.split("/") if part]
    if scheme == CLUSTER:
        if parts not in ([], ["0"]):
            raise _bad(scheme, f"a cluster has only database 0, not /{'/'.join(parts)}")
        return RedisTarget(scheme, nodes, username=username, password=password)
    if not parts or len(parts) > 2:
        raise _bad(scheme, "give the master's name after the sentinels: .../MASTER or .../MASTER/DB")
    return RedisTarget(
        scheme,
        nodes,
        master=unquote(parts[0]),
        db=_db(scheme, parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


@contextlib.asynccontextmanager
async def connect(url: str, *, answer_within: float | None = None) -> AsyncIterator[RedisClient]:
    """A client for URL, closed on the way out; ``answer_within`` (s) bounds every connect and answer. A plain
    URL sends nothing yet; a Sentinel URL asks for the master and a Cluster URL for the slot map first, so
    an unreachable one fails here, in one line (a ``redis.exceptions.ConnectionError``, like any
    unreachable Redis)."""
    scheme = scheme_of(url)
    if scheme in PLAIN:
        client = Redis.from_url(
            url,
            health_check_interval=HEALTH_CHECK_INTERVAL,
            socket_timeout=answer_within,
            socket_connect_timeout=answer_within,
        )
        try:
            yield client
        finally:
            await client.aclose()
        return
    target = parse_target(url)
    if target.scheme == CLUSTER:
        async with _cluster(target, answer_within) as cluster:
            yield cluster
        return
    async with _sentinel_master(target, answer_within) as master:
        yield master


@contextlib.asynccontextmanager
async def _cluster(target: RedisTarget, answer_within: float | None) -> AsyncIterator[RedisCluster]:
    cluster = RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        health_check_interval=HEALTH_CHECK_INTERVAL,
        socket_timeout=answer_within,
        socket_connect_timeout=answer_within,
    )
    try:
        try:
            await cluster.initialize()
        except redis.exceptions.RedisClusterException as exc:
            raise _unreachable(target, f"no listed node answers as a Redis Cluster ({exc})") from exc
        yield cluster
    finally:
        await cluster.aclose()


@contextlib.asynccontextmanager
async def _sentinel_master(target: RedisTarget, answer_within: float | None) -> AsyncIterator[Redis]:
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT,
        "socket_connect_timeout": SENTINEL_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),  # a sentinel that does not answer: ask the next one, at once
    }
    if target.sentinel_username:
        sentinel_kwargs["username"] = target.sentinel_username
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]
    # Closed from this copy: redis-py moves the sentinel that answered to the front of its own list, and
    # two lookups racing can leave one client twice in it and another not at all (never closed).
    clients = list(sentinel.sentinels)
    master = sentinel.master_for(
        target.master,
        db=target.db,
        username=target.username,
        password=target.password,
        health_check_interval=HEALTH_CHECK_INTERVAL,
        socket_timeout=answer_within,
        socket_connect_timeout=answer_within,
    )
    try:
        try:
            await sentinel.discover_master(target.master)
        except MasterNotFoundError as exc:
            why = f"no sentinel answers with a live master named {target.master!r}"
            raise _unreachable(target, why) from exc  # its message is the repr of every sentinel client
        yield master
    finally:
        await master.aclose()
        for client in clients:
            await client.aclose()


async def write_acked(
    client: RedisClient, key: str, command: Sequence[str | int], ack_within: float
) -> tuple[Any, int | None]:
    """Run COMMAND (every key it names shares KEY's slot) on the server that owns KEY; if that server has
    replicas and ACK_WITHIN > 0, ``WAIT 1`` for one of them to acknowledge it (at most ACK_WITHIN seconds).

    ``WAIT`` counts the writes of its own connection, so both go in one pipeline: one connection to one
    server (a Cluster pipeline groups commands per node; the ``WAIT`` is sent to KEY's primary). Returns
    COMMAND's answer and how many replicas acknowledged it (None: the server has none, nothing waited).
    """
    node = client.get_node_from_key(key) if isinstance(client, RedisCluster) else None
    on_node: dict[str, Any] = {} if node is None else {"target_nodes": node}
    replicas = 0
    if ack_within > 0:
        role = await client.execute_command("ROLE", **on_node)
        replicas = len(role[2]) if role[0] in (b"master", "master") else 0
    async with client.pipeline(transaction=False) as pipe:
        pipe.execute_command(*command)
        if replicas:
            pipe.execute_command("WAIT", 1, max(1, round(ack_within * 1000)), **on_node)
        answers = await pipe.execute()
    return answers[0], (int(answers[1]) if replicas else None)


def _unreachable(target: RedisTarget, why: str) -> redis.exceptions.ConnectionError:
    hosts = ",".join(f"{host}:{port}" for host, port in target.nodes)
    return redis.exceptions.ConnectionError(f"{target.scheme}://{hosts}: {why}")


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _nodes(scheme: str, hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes = []
    for part in hosts.split(","):
        if not part.strip():
            raise _bad(scheme, "list at least one HOST[:PORT], comma-separated, without empty entries")
        try:
            parsed = urlsplit(f"//{part.strip()}")
            port = parsed.port or default_port
        except ValueError as exc:
            raise _bad(scheme, f"bad HOST[:PORT] {part.strip()!r}") from exc
        if not parsed.hostname:
            raise _bad(scheme, f"bad HOST[:PORT] {part.strip()!r}")
        nodes.append((parsed.hostname, port))
    return tuple(nodes)


def _options(scheme: str, query: str) -> dict[str, str]:
    allowed = SENTINEL_OPTIONS if scheme == SENTINEL else ()
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise _bad(scheme, "malformed query string") from exc
    unknown = sorted(set(parsed) - set(allowed))
    if unknown:
        takes = f"takes only {', '.join(allowed)}" if allowed else "takes no query options"
        raise _bad(scheme, f"unknown option {', '.join(unknown)}: {scheme}:// {takes}")
    return {name: values[-1] for name, values in parsed.items()}


def _db(scheme: str, text: str) -> int:
    if not text.isdigit():
        raise _bad(scheme, f"the database after the master's name is a number, not {text!r}")
    return int(text)


def _bad(scheme: str, why: str) -> BadRequest:
    return BadRequest(f"bad {scheme}:// URL: {why}", param="redis_url")


def _schemes() -> str:
    return ", ".join(f"{scheme}://" for scheme in (*PLAIN, SENTINEL, CLUSTER))
