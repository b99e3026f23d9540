"""Every Redis key and channel kvgate uses, in one place.

Per logical ID, all keys share the hash tag ``{ID}`` so each Lua script touches one Redis Cluster slot:

    kvg:{ID}:state       hash: digest, name, path, base, epoch, updated_ms   (the current version;
                         reseeded_epoch too when a reseed wrote it)
    kvg:{ID}:versions    hash: BASE|DIGEST -> JSON {name, path, base, published_ms}
                         (every version published: a version is a digest for a base; a digest is 64 hex)
    kvg:{ID}:history     list: JSON {epoch, digest, base, action, at_ms}, newest first
                         (action: publish, rollback, bump, or reseeded: put back from a kvgate's
                         snapshot after the table came back empty)
    kvg:{ID}:lock:NAME@REPLICA   single-flight load lock (a string owner token with a TTL)

Per replica: ``kvg:replica:{URL}:loaded`` (JSON {versioned name: root}, with a TTL);
``kvg:leases:{URL}`` (hash: NAME|GATEWAY -> lease expiry ms; NAME|!unloading while an unload runs) and
``kvg:last-use:{URL}`` (hash: NAME -> last use ms, the newest any gateway reported), in the URL's slot.
Per gateway: ``kvg:gateway:{ID}`` (its heartbeat: JSON {pid, host, started_ms}, with a TTL), indexed in
``kvg:gateways``.
Indexes, each in its own slot, kept with plain SADD before the scripts that need them run:
``kvg:ids`` (logical IDs) and ``kvg:replicas`` (replica URLs). An indexed ID with no state is ignored.
``kvg:generation`` changes when Redis comes back empty. Hints go to the pub/sub channel ``kvg:hints``:
the message is a logical ID, or ``REPLICA_HINT_PREFIX`` + URL (scripts get the channel and prefix as ARGV).
``HISTORY_KEPT`` and ``DIGEST_PREFIX_MIN`` are limits the scripts get as ARGV too.

API keys (callers), one hash in one slot, written with plain commands (each change is one HSETNX or HDEL):
``kvg:callers`` maps a key id (the first ``KEY_ID_LENGTH`` hex of the key's blake3 hash) to JSON
{hash, tenant, ids, base, created_ms}; the key itself is never stored. A change is announced on
``kvg:callers:hints`` (any message: re-read the hash).
"""

from __future__ import annotations

PREFIX = "kvg"
GENERATION = f"{PREFIX}:generation"
IDS = f"{PREFIX}:ids"
REPLICAS = f"{PREFIX}:replicas"
GATEWAYS = f"{PREFIX}:gateways"
HINTS = f"{PREFIX}:hints"
REPLICA_HINT_PREFIX = "replica:"
HISTORY_KEPT = 100
DIGEST_PREFIX_MIN = 8  # a rollback target given as a digest prefix needs at least this many characters
CALLERS = f"{PREFIX}:callers"
CALLER_HINTS = f"{PREFIX}:callers:hints"
KEY_ID_LENGTH = 12


def state(logical_id: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:state"


def versions(logical_id: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:versions"


def version_field(base: str, digest: str) -> str:
    """The field of one version in ``kvg:{ID}:versions`` (lua/lib/common.lua's ``version_field``)."""
    return f"{base}|{digest}"


def history(logical_id: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:history"


def load_lock(logical_id: str, name: str, replica: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:lock:{name}@{replica}"


def replica_loaded(replica: str) -> str:
    return f"{PREFIX}:replica:{{{replica}}}:loaded"


def leases(replica: str) -> str:
    return f"{PREFIX}:leases:{{{replica}}}"


def last_use(replica: str) -> str:
    return f"{PREFIX}:last-use:{{{replica}}}"


def gateway(gateway_id: str) -> str:
    return f"{PREFIX}:gateway:{{{gateway_id}}}"
