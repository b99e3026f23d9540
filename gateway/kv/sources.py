"""Where a replica publishes its KV events: its ``GET /kv_event_sources`` answer, parsed at the boundary.

vLLM answers in one of two shapes, and kvgate reads both:

- ``{rank: config}`` (the 0.32 build): each data-parallel rank's ``KVEventsConfig`` under its rank as a
  string, ``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
  "replay_endpoint": ..., "topic": "kv", ...}}`` (rank N's ports are rank 0's + N); ``{}`` when events
  are off;
- a list of sources, each naming its rank, ``[{"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.1:5557",
  "replay_endpoint": null, "topic": ""}]`` (what vLLM's own route test expects from later builds; an
  envelope ``{"sources": [...]}`` is read as its list).

Each entry is checked on its own: a malformed one (no rank, events off, not zmq, an endpoint kvgate may
not follow, a rank named twice) is skipped with its reason (``Sources.skipped``: counted and shown on
``/healthz``), and the good ones are followed. An answer with no followable entry is a
``MalformedEvent``. ``*`` or ``0.0.0.0`` in an endpoint means the replica's own host; an endpoint on any
other host, or not ``tcp://``, is refused and never connected (``kv_event_endpoints`` names a publisher
elsewhere explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.core.errors import MalformedEvent

SOURCES_PATH = "/kv_event_sources"
MAX_RANKS = 1024  # more sources than any data-parallel deployment has: the rest are skipped


@dataclass(frozen=True, slots=True)
class Endpoints:
    publisher: str
    replay: str | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class Sources:
    """A replica's publishers by data-parallel rank, and why the entries left out were skipped."""

    ranks: dict[int, Endpoints]
    skipped: tuple[str, ...] = field(default=())


def parse_sources(answer: object, replica_url: str) -> Sources:
    """The publishers named in a ``/kv_event_sources`` answer (either shape), with a wildcard host made the
    replica's own; a malformed entry is skipped (``skipped``), none followable is a ``MalformedEvent``."""
    if isinstance(answer, dict) and isinstance(answer.get("sources"), list):
        answer = answer["sources"]
    if isinstance(answer, dict):
        entries: list[tuple[object, object]] = list(answer.items())
    elif isinstance(answer, list):
        entries = [(e.get("data_parallel_rank") if isinstance(e, dict) else None, e) for e in answer]
    else:
        raise MalformedEvent(f"{SOURCES_PATH} answered neither {{rank: config}} nor a list of sources")
    if not entries:
        raise MalformedEvent(f"{replica_url} answered no KV event sources (start it with --kv-events-config)")
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    ranks: dict[int, Endpoints] = {}
    skipped: list[str] = []
    for key, config in entries[:MAX_RANKS]:
        try:
            rank = _rank(key)
            if rank in ranks:
                raise MalformedEvent(f"rank {rank} is named twice")
            ranks[rank] = _endpoints(config, host, replica_url)
        except MalformedEvent as exc:
            skipped.append(exc.message[:200])
    skipped += [f"{len(entries) - MAX_RANKS} sources past {MAX_RANKS}"] if len(entries) > MAX_RANKS else []
    if not ranks:
        raise MalformedEvent("; ".join(skipped[:3]))
    return Sources(dict(sorted(ranks.items())), tuple(skipped))


def _rank(key: object) -> int:
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 6:
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < MAX_RANKS:
        return key
    raise MalformedEvent(f"a KV event source's data-parallel rank is a small int, not {str(key)[:20]!r}")


def _endpoints(config: object, host: str, replica_url: str) -> Endpoints:
    """One rank's publisher. The list shape names no ``enable_kv_cache_events`` nor ``publisher`` (every
    source it lists is a zmq publisher); where they are named, they must say so."""
    if not isinstance(config, dict) or config.get("enable_kv_cache_events", True) is not True:
        raise MalformedEvent(f"{replica_url} does not publish KV events (start it with --kv-events-config)")
    if config.get("publisher", "zmq") != "zmq" or not isinstance(config.get("endpoint"), str):
        raise MalformedEvent(f"{replica_url} publishes KV events with {config.get('publisher')!r}, not zmq")
    replay = config.get("replay_endpoint")
    topic = config.get("topic") or ""
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
