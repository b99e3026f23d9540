"""Every Redis key and channel kvgate uses, in one place.

The epoch table lives in ONE Redis Cluster slot: every key of it carries the hash tag ``{epochs}``
(``TABLE_TAG``; slot 751, ``CLUSTER KEYSLOT kvg:{epochs}:ids``), so each script can write the change and
its change-log entry in the same slot, atomically:

    kvg:{epochs}:state:ID     hash: digest, name, path, base, epoch, updated_ms   (the current version;
                              reseeded_epoch too when a reseed wrote it; while a rollout runs, its
                              candidate: cand_digest, cand_name, cand_path, cand_base, cand_base_print,
                              cand_weight, cand_split (absent in older rollouts); last_rollout: JSON
                              of how the last one ended)
    kvg:{epochs}:versions:ID  hash: BASE|DIGEST -> JSON {name, path, base, published_ms}
                              (every version published: a version is a digest for a base; a digest is 64 hex)
    kvg:{epochs}:history:ID   list: JSON {epoch, digest, base, action, at_ms}, newest first
                              (action: publish, rollback, bump, promote, or reseeded: put back from a
                              kvgate's snapshot after the table came back empty; a rollout's events,
                              rollout, weight and abort, also carry role 'candidate', weight, reason;
                              a rollout's start its split key, split)
    kvg:{epochs}:ids          set: the logical IDs (an indexed ID with no state is ignored)
    kvg:{epochs}:generation   string: changes when Redis comes back empty
    kvg:{epochs}:log          stream: the change log, one entry per change of a current version (XADD in
                              the same script as the change; trimmed MAXLEN ~ ``LOG_KEPT``, a setting):
                              fields id, action (publish, rollback, bump, reseeded, drift), then the
                              state hash as the change left it (none: the ID has no state any more)
    kvg:{epochs}:rows         hash: ID -> row hash (``row_hash``) of the state the scripts last logged
    kvg:{epochs}:check        hash: sum (the sum of rows, mod nothing: 40-bit rows fit int64 for 8M IDs),
                              last (the id of the newest log entry), scrub_cursor, scrub_at_ms, scrub_rounds

Tradeoff: on a Cluster the whole table (all IDs, their versions and histories, the log) is on the one
master that owns slot 751, so it does not shard. With the change log, kvgates read it per change, not
per ID per second, so one master carries it comfortably (docs/scale.md measures 100,000 IDs); a full read
is a paged read of that one node. What is hot per request or per replica stays spread over the Cluster:
``kvg:{ID}:lock:NAME@REPLICA`` (single-flight load lock, a string owner token with a TTL) keeps the hash
tag ``{ID}``, and the replica and gateway keys below keep theirs. The alternatives (one stream per slot,
or per slot group with the IDs' keys renamed into groups) make every kvgate block on many streams, one
XREAD per slot, for a sharding this table does not need at this size.

Per replica: ``kvg:replica:{URL}:loaded`` (JSON {versioned name: root}, with a TTL);
``kvg:leases:{URL}`` (hash: NAME|GATEWAY -> lease expiry ms; NAME|!unloading while an unload runs) and
``kvg:last-use:{URL}`` (hash: NAME -> last use ms, the newest any gateway reported), in the URL's slot.
Per running rollout (the candidate's digest names it, so the next rollout starts afresh), in its ID's slot:
``kvg:{ID}:gate:DIGEST`` (hash: holder, until_ms, round_ms: which kvgate process gates it, until when,
and when its last audit round began) and ``kvg:{ID}:rollout-counts:DIGEST`` (hash: ROLE:FIGURE -> a whole
number, every kvgate's traffic of the rollout added up); both expire by themselves once nobody writes.
Per gateway: ``kvg:gateway:{ID}`` (its heartbeat: JSON {pid, host, started_ms}, with a TTL), indexed in
``kvg:gateways``.
``kvg:replicas`` indexes the replica URLs (plain SADD before record_loaded runs). A replica's loaded set
changing is hinted on the pub/sub channel ``kvg:hints`` as ``REPLICA_HINT_PREFIX`` + URL: those keys live
in their URLs' slots, not the table's, so they stay out of the change log (pub/sub is only a nudge to
re-list a replica sooner than the next poll; nothing depends on receiving it).
``HISTORY_KEPT``, ``DIGEST_PREFIX_MIN`` and the log's length are limits the scripts get as ARGV.

API keys (callers), one hash in one slot, written with plain commands (each change is one HSETNX or HDEL):
``kvg:callers`` maps a key id (the first ``KEY_ID_LENGTH`` hex of the key's blake3 hash) to JSON
{hash, tenant, ids, base, created_ms}; the key itself is never stored. A change is announced on
``kvg:callers:hints`` (any message: re-read the hash).
"""

from __future__ import annotations

PREFIX = "kvg"
TABLE_TAG = "{epochs}"
TABLE = f"{PREFIX}:{TABLE_TAG}"
GENERATION = f"{TABLE}:generation"
IDS = f"{TABLE}:ids"
LOG = f"{TABLE}:log"
ROWS = f"{TABLE}:rows"
CHECK = f"{TABLE}:check"
STATE_PREFIX = f"{TABLE}:state:"  # then the ID (the scrub script builds the names it reads from it)
LOG_KEPT = 10_000  # change-log entries kept, by default (XADD MAXLEN ~)
SCRUB_PAGE = 1_000  # IDs the scrub re-reads per heartbeat, by default
REPLICAS = f"{PREFIX}:replicas"
GATEWAYS = f"{PREFIX}:gateways"
HINTS = f"{PREFIX}:hints"
REPLICA_HINT_PREFIX = "replica:"
HISTORY_KEPT = 100
DIGEST_PREFIX_MIN = 8  # a rollback target given as a digest prefix needs at least this many characters
CALLERS = f"{PREFIX}:callers"
CALLER_HINTS = f"{PREFIX}:callers:hints"
CALLERS_MARK = "!made"
"""A field of ``CALLERS`` (never a key id: those are hex), a random token set when the first key is made: a
key table without it (or with another one) where a kvgate had read keys was wiped (``FLUSHALL``, Redis
back empty), not emptied by revokes."""
KEY_ID_LENGTH = 12


def state(logical_id: str) -> str:
    return f"{STATE_PREFIX}{logical_id}"


def versions(logical_id: str) -> str:
    return f"{TABLE}:versions:{logical_id}"


def version_field(base: str, digest: str) -> str:
    """The field of one version in ``kvg:{ID}:versions`` (lua/lib/common.lua's ``version_field``)."""
    return f"{base}|{digest}"


def history(logical_id: str) -> str:
    return f"{TABLE}:history:{logical_id}"


def load_lock(logical_id: str, name: str, replica: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:lock:{name}@{replica}"


def replica_loaded(replica: str) -> str:
    return f"{PREFIX}:replica:{{{replica}}}:loaded"


def leases(replica: str) -> str:
    return f"{PREFIX}:leases:{{{replica}}}"


def last_use(replica: str) -> str:
    return f"{PREFIX}:last-use:{{{replica}}}"


def rollout_gate(logical_id: str, digest: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:gate:{digest}"


def rollout_counts(logical_id: str, digest: str) -> str:
    return f"{PREFIX}:{{{logical_id}}}:rollout-counts:{digest}"


def gateway(gateway_id: str) -> str:
    return f"{PREFIX}:gateway:{{{gateway_id}}}"
