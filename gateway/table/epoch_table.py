"""The shared epoch table in Redis: one thin typed wrapper over the Lua scripts in ``lua/``.

Every mutation is one script (atomic, one Cluster slot, logged: changelog.py), assembled by
``table.scripts`` (``lua/lib/common.lua`` prepended). ``_raise_for`` is the one place that maps the
scripts' status codes (the lib's ``CODE`` table) to exceptions.
``now`` is passed in (ms) so tests control time.

The table runs on any ``RedisClient`` (one server, Sentinel-managed, or a Cluster: every script's keys
share one hash slot). Publish, rollback and bump wait for one Redis replica to acknowledge their writes
when the server that ran them has replicas (``write_acked``), so an acknowledged change survives a
failover; if none acknowledges within ``ack_timeout`` the change stands and a warning says it may not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis.exceptions
from opentelemetry.trace import NoOpTracer, Span, Tracer
from redis.commands.core import AsyncScript

from gateway.core.errors import (
    BadRequest,
    EpochTableError,
    MalformedRow,
    ModelNotFound,
    RolloutConflict,
    ScriptRefused,
    VersionNotFound,
)
from gateway.core.model import Change, TableView, VersionState
from gateway.table import keys
from gateway.table.connection import RedisClient, write_acked
from gateway.table.replies import as_text
from gateway.table.rows import parse_history_event, parse_state
from gateway.table.scripts import assemble_script, codes, operation_names
from gateway.telemetry import tracing as attr

log = logging.getLogger(__name__)
Clock = Callable[[], int]
REDIS_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,  # a Cluster answering CLUSTERDOWN while it fails over
    OSError,
)
"""What an unreachable Redis raises: callers that can serve from the snapshot catch exactly these."""
REDIS_REFUSED = (redis.exceptions.ResponseError, ScriptRefused)
"""Redis answered and refused the command: ``maxmemory`` reached ("OOM command not allowed", an
``OutOfMemoryError``), a read-only replica, a script's error, a script's refusal of what Redis holds
(``ScriptRefused``: nothing written). Not an outage (reads still work, so the
snapshot is never flushed for it); a loop whose step writes (the replica poll's record, the leases
heartbeat) waits it out like an outage and writes again at its next step."""
READ_PAGE = 1_000  # IDs per page of a full read
PREFIX_MIN = keys.DIGEST_PREFIX_MIN
LOGGED = (keys.LOG, keys.ROWS, keys.CHECK)  # the change log's keys, declared by every logged script
ACK_TIMEOUT = 1.0
"""Seconds a publish, rollback or bump waits for a Redis replica's acknowledgement, by default."""


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class EpochTable:
    def __init__(
        self,
        redis: RedisClient,
        *,
        clock: Clock = wall_clock_ms,
        tracer: Tracer | None = None,
        ack_timeout: float = ACK_TIMEOUT,
        log_kept: int = keys.LOG_KEPT,
    ) -> None:
        self.redis = redis
        self.log_kept = log_kept  # change-log entries kept (XADD MAXLEN ~)
        self.clock = clock
        self.tracer = tracer or NoOpTracer()
        self.ack_timeout = ack_timeout
        self.scripts: dict[str, AsyncScript] = {
            name: redis.register_script(assemble_script(name)) for name in operation_names()
        }

    async def run(self, script: str, keys_: Sequence[str], args: Sequence[str | int]) -> Any:
        return refused(await self.scripts[script](keys=list(keys_), args=list(args)))

    async def run_acked(self, script: str, keys_: Sequence[str], args: Sequence[str | int]) -> Any:
        """A logged change run like publish, rollback and bump (``table.rollouts`` runs its scripts so)."""
        return await self._run_acked(script, keys_, args)

    async def _run_acked(self, script: str, keys_: Sequence[str], args: Sequence[str | int]) -> Any:
        """``_run`` for a change that must survive a failover: a replica of its server acknowledges it."""
        registered = self.scripts[script]
        # Loaded first: a NOSCRIPT inside the pipeline would still run its WAIT, for nothing.
        if not all(await self.redis.script_exists(registered.sha)):  # a new master after a failover, say
            await self.redis.script_load(registered.script)
        command = ("EVALSHA", registered.sha, len(keys_), *keys_, *args)
        try:
            return await self._acked(command, keys_[0], f"{script} on {keys_[0]}")
        except redis.exceptions.NoScriptError:  # the master changed between the check and the run
            await self.redis.script_load(registered.script)
            return await self._acked(command, keys_[0], f"{script} on {keys_[0]}")

    async def _acked(self, command: Sequence[str | int], key: str, what: str) -> Any:
        answer, acked = await write_acked(self.redis, key, command, self.ack_timeout)
        refused(answer)
        if acked == 0:
            log.warning(
                "%s: no Redis replica acknowledged it within %g s; the write stands on the master, "
                "but a failover before it replicates would lose it",
                what,
                self.ack_timeout,
            )
        return answer

    @contextlib.contextmanager
    def _span(self, name: str, logical_id: str, digest: str = "") -> Iterator[Span]:
        with self.tracer.start_as_current_span(name) as span:
            span.set_attribute(attr.LOGICAL_ID, logical_id)
            if digest:
                span.set_attribute(attr.VERSION_DIGEST, digest)
            yield span

    # --- mutations -------------------------------------------------------------------------------

    async def ensure_generation(self, *, acked: bool = False) -> str:
        run = self._run_acked if acked else self.run
        return as_text(await run("ensure_generation", [keys.GENERATION], [secrets.token_hex(8)]))

    async def publish(
        self, logical_id: str, digest: str, name: str, path: str, base: str, base_print: str = ""
    ) -> Change:
        """BASE_PRINT: the fingerprint of the base it is published for ('' : none; see base_print.py)."""
        with self._span("kvgate.publish", logical_id, digest=digest) as span:
            change = await self._publish(logical_id, digest, name, path, base, base_print)
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def _publish(
        self, logical_id: str, digest: str, name: str, path: str, base: str, base_print: str
    ) -> Change:
        await self.ensure_generation(acked=True)  # on a Cluster, these two live on other servers
        await self._acked(("SADD", keys.IDS, logical_id), keys.IDS, f"adding {logical_id!r} to {keys.IDS}")
        code, epoch = await self._run_acked(
            "publish_version",
            [keys.state(logical_id), keys.versions(logical_id), keys.history(logical_id), *LOGGED],
            [
                logical_id,
                digest,
                name,
                path,
                base,
                self.clock(),
                self.log_kept,
                keys.HISTORY_KEPT,
                base_print,
            ],
        )
        _raise_for(int(code), logical_id, digest, base)
        return Change(changed=int(code) == codes()["CHANGED"], epoch=int(epoch), digest=digest)

    async def rollback(self, logical_id: str, digest: str, base: str) -> Change:
        """Go back to DIGEST (or a unique prefix of at least ``keys.DIGEST_PREFIX_MIN``; '' for the
        previous version), choosing only among versions published for BASE."""
        with self._span("kvgate.rollback", logical_id, digest=digest) as span:
            change = await self._rollback(logical_id, digest, base)
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def _rollback(self, logical_id: str, digest: str, base: str) -> Change:
        code, epoch, target = await self._run_acked(
            "rollback_version",
            [keys.state(logical_id), keys.versions(logical_id), keys.history(logical_id), *LOGGED],
            [logical_id, digest, base, self.clock(), self.log_kept, keys.HISTORY_KEPT, PREFIX_MIN],
        )
        _raise_for(int(code), logical_id, digest, base)
        return Change(changed=int(code) == codes()["CHANGED"], epoch=int(epoch), digest=as_text(target))

    async def bump(self, logical_id: str) -> Change:
        with self._span("kvgate.bump", logical_id) as span:
            change = await self._bump(logical_id)
            span.set_attribute(attr.EPOCH, change.epoch)
            return change

    async def _bump(self, logical_id: str) -> Change:
        code, epoch = await self._run_acked(
            "bump_epoch",
            [keys.state(logical_id), keys.history(logical_id), *LOGGED],
            [logical_id, self.clock(), self.log_kept, keys.HISTORY_KEPT],
        )
        _raise_for(int(code), logical_id, "")
        return Change(changed=True, epoch=int(epoch))

    async def reseed(
        self, logical_id: str, digest: str, name: str, path: str, base: str, epoch: int
    ) -> Change:
        """Put back a version a snapshot held, at its epoch, after the table came back empty (see
        ``lua/reseed_version.lua``). ``changed`` False: the ID's version stays; ``epoch`` is its epoch."""
        await self.redis.sadd(keys.IDS, logical_id)
        code, current = await self.run(
            "reseed_version",
            [keys.state(logical_id), keys.versions(logical_id), keys.history(logical_id), *LOGGED],
            [logical_id, digest, name, path, base, epoch, self.clock(), self.log_kept, keys.HISTORY_KEPT],
        )
        _raise_for(int(code), logical_id, digest, base)
        return Change(changed=int(code) == codes()["CHANGED"], epoch=int(current), digest=digest)

    async def record_loaded(self, replica: str, loaded: dict[str, str], ttl_ms: int) -> bool:
        await self.redis.sadd(keys.REPLICAS, replica)
        doc = json.dumps(loaded, sort_keys=True, separators=(",", ":"))
        changed = await self.run(
            "record_loaded",
            [keys.replica_loaded(replica)],
            [replica, doc, ttl_ms, keys.HINTS, keys.REPLICA_HINT_PREFIX],
        )
        return int(changed) == codes()["CHANGED"]

    async def acquire_load_lock(
        self, logical_id: str, name: str, replica: str, token: str, ttl_ms: int
    ) -> bool:
        got = await self.run("acquire_lock", [keys.load_lock(logical_id, name, replica)], [token, ttl_ms])
        return int(got) == 1

    async def release_load_lock(self, logical_id: str, name: str, replica: str, token: str) -> bool:
        released = await self.run("release_lock", [keys.load_lock(logical_id, name, replica)], [token])
        return int(released) == 1

    # --- reads -----------------------------------------------------------------------------------

    async def read_state(self, logical_id: str) -> VersionState | None:
        raw: dict[bytes, bytes] = await self.redis.hgetall(keys.state(logical_id))  # type: ignore[assignment]
        return parse_state(logical_id, raw)

    async def has_version(self, logical_id: str, base: str, digest: str) -> bool:
        """Whether DIGEST was ever published (or re-seeded) for BASE under LOGICAL_ID."""
        return bool(await self.redis.hexists(keys.versions(logical_id), keys.version_field(base, digest)))

    async def read_all(self, page: int = READ_PAGE) -> TableView:
        """Every current version, all of one generation, a page at a time (lua/read_page.lua: SSCAN COUNT
        PAGE and the page's state hashes in one bounded reply): a read the table was emptied under is read
        again (else it would show the old generation with no IDs, and the snapshot would forget them)."""
        while True:
            generation, cursor = await self.ensure_generation(), "0"
            states: dict[str, VersionState] = {}
            malformed: dict[str, str] = {}
            while True:
                cursor, rows = await self.run("read_page", [keys.IDS], [cursor, page, keys.STATE_PREFIX])
                # bytes that are not UTF-8 come through as they are: kept (surrogates) for the row's check
                for logical_id, fields in json.loads(as_text(rows, "surrogateescape")):
                    raw = {_raw(name): _raw(value) for name, value in fields.items()}
                    try:
                        state = parse_state(logical_id, raw)
                    except MalformedRow as exc:
                        malformed[logical_id] = exc.reason
                        continue
                    if state is not None:
                        states[logical_id] = state
                if (cursor := as_text(cursor)) == "0":
                    break
            if as_text(await self.redis.get(keys.GENERATION) or b"") == generation:
                return TableView(generation, states, malformed)

    async def read_history(self, logical_id: str, malformed: list[str] | None = None) -> list[dict[str, Any]]:
        """The ID's history, newest first, parsed one entry at a time: an entry that is not one is left
        out, and why is added to ``malformed`` (when given: ``kvgate history`` and ``gc`` say so)."""
        events = []
        for position, item in enumerate(await self.redis.lrange(keys.history(logical_id), 0, -1)):
            try:
                events.append(parse_history_event(logical_id, position, item))
            except MalformedRow as exc:
                if malformed is not None:
                    malformed.append(exc.reason)
        return events

    async def read_loaded(self) -> dict[str, dict[str, str]]:
        replicas = sorted(as_text(r, "replace") for r in await self.redis.smembers(keys.REPLICAS))
        loaded: dict[str, dict[str, str]] = {}
        for replica in replicas:
            doc = await self.redis.get(keys.replica_loaded(replica))
            if doc is not None:
                loaded[replica] = _loaded_doc(replica, doc)
        return loaded


def refused(answer: Any) -> Any:
    """ANSWER, unless it is a script's refusal ``{CODE.MALFORMED, why}`` (lua/lib/common.lua: what it reads
    in Redis is not what the scripts write; nothing was written): then ``ScriptRefused`` naming why."""
    if isinstance(answer, list) and len(answer) == 2 and answer[0] == codes()["MALFORMED"]:
        raise ScriptRefused(as_text(answer[1], "replace"))
    return answer


def raise_for(code: int, logical_id: str, digest: str, base: str = "") -> None:
    """``_raise_for`` for the table's other wrappers (``table.rollouts``)."""
    _raise_for(code, logical_id, digest, base)


def _raise_for(code: int, logical_id: str, digest: str, base: str = "") -> None:
    """The one map from Lua status codes (the lib's CODE table, by name) to exceptions."""
    name = {value: key for key, value in codes().items()}.get(code)
    if name in ("CHANGED", "UNCHANGED"):
        return
    if name == "NO_CURRENT_VERSION":
        raise ModelNotFound(f"logical ID {logical_id!r} has no published version", param="model")
    for_base = f" for base {base!r}" if base else ""
    if name == "NO_SUCH_VERSION":
        wanted = f"version {digest!r}" if digest else "earlier version"
        raise VersionNotFound(f"{logical_id!r} has no {wanted}{for_base}", param="digest")
    if name == "AMBIGUOUS_PREFIX":
        raise VersionNotFound(
            f"digest prefix {digest!r} of {logical_id!r} is ambiguous{for_base}", param="digest"
        )
    if name == "NO_CANDIDATE":
        wanted = f" with candidate {digest!r}" if digest else ""
        raise RolloutConflict(f"no rollout of {logical_id!r}{wanted} is running", param="model")
    if name == "ROLLOUT_RUNNING":
        raise RolloutConflict(
            f"a rollout of {logical_id!r} is running: promote or abort it first (kvgate promote / abort)",
            param="model",
        )
    if name == "CANDIDATE_IS_CURRENT":
        raise RolloutConflict(f"{digest[:16]!r} is already {logical_id!r}'s current version", param="digest")
    if name == "PREFIX_TOO_SHORT":
        raise BadRequest(
            f"digest prefix {digest!r} is too short: give at least {keys.DIGEST_PREFIX_MIN} hex characters",
            param="digest",
        )
    raise EpochTableError(f"epoch table script returned unknown code {code}")


def _loaded_doc(replica: str, doc: bytes | str) -> dict[str, str]:
    """What a replica has loaded (name -> root) as recorded; a record that is not one reads as nothing."""
    try:
        loaded = json.loads(as_text(doc, "replace"))
    except (ValueError, RecursionError):
        loaded = None
    if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
        log.warning("the loaded adapters recorded for %s are malformed: left out", replica)
        return {}
    return loaded


def _raw(value: str) -> bytes:
    """A string read with ``surrogateescape`` as the bytes Redis held."""
    return value.encode(errors="surrogateescape")
