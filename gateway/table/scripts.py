"""The Lua scripts of the epoch table, and one typed call each (the shape of BullMQ's ``scripts.py``).

Each operation ``lua/NAME.lua`` runs with ``lua/lib/common.lua`` prepended (``assemble_script``;
``kvgate script NAME`` prints the same text for ``redis-cli --eval``). ``Scripts`` registers every one once
(redis-py's ``register_script``: EVALSHA, and the text again on NOSCRIPT) and has one method per script,
named after it: the method builds the script's keys (``table.keys``), passes its arguments in the order
the script's header lists them, and parses the reply. ``Code`` is the lib's ``CODE`` table (a test keeps
the two the same) and ``raise_for`` the one map from a code to the error tree's exceptions; a refusal
(``{CODE.MALFORMED, why}``: nothing written) raises ``ScriptRefused``. No module outside this one names a
script. ``now`` is passed in (ms), so tests control time.

Publish, rollback, bump and a rollout's scripts wait for one Redis replica to acknowledge their writes when
the server that ran them has replicas (``write_acked``), so an acknowledged change survives a failover;
if none acknowledges within ``ack_timeout`` the change stands and a warning says it may not.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import re
import secrets
import types
from collections.abc import Mapping, Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import redis.exceptions
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
from gateway.core.model import Change, RolloutChange
from gateway.table import keys
from gateway.table.connection import RedisClient, write_acked
from gateway.table.replies import as_text

log = logging.getLogger(__name__)

# --- the scripts' text -------------------------------------------------------------------------------


def lua_dir() -> Traversable:
    """``lua/`` beside the package in a source tree; ``gateway/lua`` inside an installed wheel."""
    source_tree = Path(__file__).resolve().parents[2] / "lua"
    if source_tree.is_dir():
        return source_tree
    return resources.files("gateway.lua")


LIB = ("lib", "common.lua")
"""Prepended to every operation: the CODE table and the helpers the scripts share (not an operation)."""


def lib_source() -> str:
    folder, name = LIB  # one joinpath a step: an installed gateway.lua is a namespace package's path
    return lua_dir().joinpath(folder).joinpath(name).read_text()


def operation_names() -> list[str]:
    """Every operation script: each ``lua/*.lua`` (the lib lives in a subfolder)."""
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in lua_dir().iterdir()
        if entry.is_file() and entry.name.endswith(".lua")
    )


def assemble_script(name: str) -> str:
    """The self-contained text Redis runs for operation NAME: the lib, then ``lua/NAME.lua``."""
    if name not in operation_names():
        raise BadRequest(f"no epoch table script {name!r}; one of {', '.join(operation_names())}")
    operation = lua_dir().joinpath(f"{name}.lua").read_text()
    banner = f"-- kvgate script {name}: lua/{'/'.join(LIB)}, then lua/{name}.lua\n"
    return f"{banner}{lib_source()}\n{operation}"


# --- status codes --------------------------------------------------------------------------------------


class Code(enum.IntEnum):
    """The scripts' status codes: lua/lib/common.lua's ``CODE`` table (``codes()`` reads it; a test checks
    the two agree)."""

    CHANGED = 1
    UNCHANGED = 0
    NO_CURRENT_VERSION = -1
    NO_SUCH_VERSION = -2
    AMBIGUOUS_PREFIX = -3
    PREFIX_TOO_SHORT = -4
    LEASED = -5
    UNLOADING = -6
    CURRENT = -7
    NO_CANDIDATE = -8
    ROLLOUT_RUNNING = -9
    CANDIDATE_IS_CURRENT = -10
    MALFORMED = -11


_CODE_TABLE = re.compile(r"^local CODE = \{\n(?P<body>.*?)^\}", re.MULTILINE | re.DOTALL)
_CODE_ENTRY = re.compile(r"(?P<name>[A-Z][A-Z_]*)\s*=\s*(?P<value>-?\d+)\s*,?")


def parse_codes(lua: str) -> Mapping[str, int]:
    """The ``local CODE = {NAME = number, ...}`` table of the lib, one entry a line (``--`` comments)."""
    table = _CODE_TABLE.search(lua)
    if table is None:
        raise EpochTableError("the Lua lib has no `local CODE = {...}` table")
    found: dict[str, int] = {}
    for line in table["body"].splitlines():
        text = line.split("--", 1)[0].strip()
        if not text:
            continue
        entry = _CODE_ENTRY.fullmatch(text)
        if entry is None or entry["name"] in found:
            raise EpochTableError(f"cannot read Lua CODE entry {text!r}")
        found[entry["name"]] = int(entry["value"])
    if len(set(found.values())) != len(found):
        raise EpochTableError(f"Lua CODE values are not distinct: {found}")
    return types.MappingProxyType(found)


@functools.cache
def codes() -> Mapping[str, int]:
    """The status codes by name as the lib writes them (what ``Code`` must match)."""
    return parse_codes(lib_source())


def code_of(value: Any) -> Code:
    """A script's status code as a ``Code``; ``EpochTableError`` for a number the lib does not define."""
    try:
        return Code(int(value))
    except ValueError:
        raise EpochTableError(f"epoch table script returned unknown code {value}") from None


def raise_for(code: int, logical_id: str, digest: str, base: str = "") -> Code:
    """The one map from status codes to exceptions: CODE back when it is CHANGED or UNCHANGED, else the
    error it means."""
    code = code_of(code)
    if code in (Code.CHANGED, Code.UNCHANGED):
        return code
    if code is Code.NO_CURRENT_VERSION:
        raise ModelNotFound(f"logical ID {logical_id!r} has no published version", param="model")
    for_base = f" for base {base!r}" if base else ""
    if code is Code.NO_SUCH_VERSION:
        wanted = f"version {digest!r}" if digest else "earlier version"
        raise VersionNotFound(f"{logical_id!r} has no {wanted}{for_base}", param="digest")
    if code is Code.AMBIGUOUS_PREFIX:
        raise VersionNotFound(
            f"digest prefix {digest!r} of {logical_id!r} is ambiguous{for_base}", param="digest"
        )
    if code is Code.NO_CANDIDATE:
        wanted = f" with candidate {digest!r}" if digest else ""
        raise RolloutConflict(f"no rollout of {logical_id!r}{wanted} is running", param="model")
    if code is Code.ROLLOUT_RUNNING:
        raise RolloutConflict(
            f"a rollout of {logical_id!r} is running: promote or abort it first (kvgate promote / abort)",
            param="model",
        )
    if code is Code.CANDIDATE_IS_CURRENT:
        raise RolloutConflict(f"{digest[:16]!r} is already {logical_id!r}'s current version", param="digest")
    if code is Code.PREFIX_TOO_SHORT:
        raise BadRequest(
            f"digest prefix {digest!r} is too short: give at least {keys.DIGEST_PREFIX_MIN} hex characters",
            param="digest",
        )
    raise EpochTableError(f"epoch table script returned unexpected code {code.name} ({int(code)})")


def refused(answer: Any) -> Any:
    """ANSWER, unless it is a script's refusal ``{CODE.MALFORMED, why}`` (lua/lib/common.lua: what it reads
    in Redis is not what the scripts write; nothing was written): then ``ScriptRefused`` naming why."""
    if isinstance(answer, list) and len(answer) == 2 and answer[0] == Code.MALFORMED:
        raise ScriptRefused(as_text(answer[1], "replace"))
    return answer


# --- one method per script -----------------------------------------------------------------------------

LOGGED = (keys.LOG, keys.ROWS, keys.CHECK)
"""The change log's keys, declared (last) by every script that changes a current version."""
ACK_TIMEOUT = 1.0
"""Seconds a publish, rollback, bump or rollout waits for a Redis replica's acknowledgement, by default."""
Rows = list[tuple[str, dict[bytes, bytes]]]
"""A page of a full read: each logical ID with its state hash's fields as Redis holds them."""


def _table_keys(logical_id: str, *, versions: bool = True) -> list[str]:
    """A logged script's keys: the ID's state, its versions (when the script reads them), its history, then
    the change log's."""
    own = [
        keys.state(logical_id),
        *([keys.versions(logical_id)] if versions else []),
        keys.history(logical_id),
    ]
    return [*own, *LOGGED]


class Scripts:
    """Every ``lua/*.lua``, registered on REDIS, as one typed method each."""

    def __init__(
        self, redis: RedisClient, *, ack_timeout: float = ACK_TIMEOUT, log_kept: int = keys.LOG_KEPT
    ) -> None:
        self.redis = redis
        self.ack_timeout = ack_timeout
        self.log_kept = log_kept  # change-log entries kept (XADD MAXLEN ~)
        self.registered: Mapping[str, AsyncScript] = types.MappingProxyType(
            {name: redis.register_script(assemble_script(name)) for name in operation_names()}
        )

    # --- running one ---------------------------------------------------------------------------------

    async def run(self, name: str, keys_: Sequence[str], args: Sequence[str | int]) -> Any:
        """Script NAME on KEYS_ and ARGS as given (the methods below build them): its reply, unless
        refused."""
        return refused(await self.registered[name](keys=list(keys_), args=list(args)))

    async def run_acked(self, name: str, keys_: Sequence[str], args: Sequence[str | int]) -> Any:
        """``run`` for a change that must survive a failover: a replica of its server acknowledges it."""
        registered = self.registered[name]
        # Loaded first: a NOSCRIPT inside the pipeline would still run its WAIT, for nothing.
        if not all(await self.redis.script_exists(registered.sha)):  # a new master after a failover, say
            await self.redis.script_load(registered.script)
        command = ("EVALSHA", registered.sha, len(keys_), *keys_, *args)
        try:
            return await self._acked(command, keys_[0], f"{name} on {keys_[0]}")
        except redis.exceptions.NoScriptError:  # the master changed between the check and the run
            await self.redis.script_load(registered.script)
            return await self._acked(command, keys_[0], f"{name} on {keys_[0]}")

    async def _acked(self, command: Sequence[str | int], key: str, what: str) -> Any:
        """COMMAND's answer (unless refused), after a replica's acknowledgement or a warning that none
        came."""
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

    # --- the epoch table: lua/ensure_generation, publish_version, rollback_version, bump_epoch, ... --------

    async def ensure_generation(self, *, acked: bool = False) -> str:
        """The table's generation id, made (random) when the table has none."""
        run = self.run_acked if acked else self.run
        return as_text(await run("ensure_generation", [keys.GENERATION], [secrets.token_hex(8)]))

    async def publish_version(
        self, logical_id: str, digest: str, name: str, path: str, base: str, base_print: str, *, now: int
    ) -> Change:
        """DIGEST (versioned NAME, stored at PATH, built for BASE) becomes LOGICAL_ID's current version; the
        ID is indexed first (on a Cluster ``kvg:{epochs}:ids`` may live on another server)."""
        await self._acked(("SADD", keys.IDS, logical_id), keys.IDS, f"adding {logical_id!r} to {keys.IDS}")
        _, keys_, args = self.publish_version_call(logical_id, digest, name, path, base, base_print, now=now)
        code, epoch = await self.run_acked("publish_version", keys_, args)
        changed = raise_for(code, logical_id, digest, base) is Code.CHANGED
        return Change(changed=changed, epoch=int(epoch), digest=digest)

    def publish_version_call(
        self, logical_id: str, digest: str, name: str, path: str, base: str, base_print: str, *, now: int
    ) -> tuple[AsyncScript, list[str], list[str | int]]:
        """The script, keys and arguments of ``publish_version``, for a caller that pipelines thousands
        (loadtest/scale.py fills a table so; it indexes the IDs itself)."""
        args: list[str | int] = [logical_id, digest, name, path, base, now, self.log_kept, keys.HISTORY_KEPT]
        return self.registered["publish_version"], _table_keys(logical_id), [*args, base_print]

    async def rollback_version(self, logical_id: str, digest: str, base: str, *, now: int) -> Change:
        """Back to DIGEST (or a unique prefix; '' for the previous version) among BASE's versions."""
        code, epoch, target = await self.run_acked(
            "rollback_version",
            _table_keys(logical_id),
            [logical_id, digest, base, now, self.log_kept, keys.HISTORY_KEPT, keys.DIGEST_PREFIX_MIN],
        )
        changed = raise_for(code, logical_id, digest, base) is Code.CHANGED
        return Change(changed=changed, epoch=int(epoch), digest=as_text(target))

    async def bump_epoch(self, logical_id: str, *, now: int) -> Change:
        code, epoch = await self.run_acked(
            "bump_epoch",
            _table_keys(logical_id, versions=False),
            [logical_id, now, self.log_kept, keys.HISTORY_KEPT],
        )
        raise_for(code, logical_id, "")
        return Change(changed=True, epoch=int(epoch))

    async def reseed_version(
        self, logical_id: str, digest: str, name: str, path: str, base: str, epoch: int, *, now: int
    ) -> Change:
        """Put back a version a snapshot held, at EPOCH (``changed`` False: the ID's version stays)."""
        await self.redis.sadd(keys.IDS, logical_id)
        code, current = await self.run(
            "reseed_version",
            _table_keys(logical_id),
            [logical_id, digest, name, path, base, epoch, now, self.log_kept, keys.HISTORY_KEPT],
        )
        changed = raise_for(code, logical_id, digest, base) is Code.CHANGED
        return Change(changed=changed, epoch=int(current), digest=digest)

    async def forget_version(self, logical_id: str, digest: str) -> bool:
        """Drop DIGEST's version records; False, and nothing dropped, when it is current (or the
        candidate)."""
        code, _ = await self.run(
            "forget_version", [keys.state(logical_id), keys.versions(logical_id)], [digest]
        )
        code = code_of(code)
        if code not in (Code.CHANGED, Code.CURRENT):
            raise EpochTableError(f"forget_version returned unknown code {int(code)}")
        return code is Code.CHANGED

    async def read_page(self, cursor: str, page: int) -> tuple[str, Rows]:
        """One page of a full read from CURSOR: the next cursor ('0': the last page) and the page's rows
        (bytes that are not UTF-8 come through as Redis holds them, for the row's own check)."""
        next_cursor, rows = await self.run("read_page", [keys.IDS], [cursor, page, keys.STATE_PREFIX])
        page_rows = [
            (logical_id, {_raw(name): _raw(value) for name, value in fields.items()})
            for logical_id, fields in json.loads(as_text(rows, "surrogateescape"))
        ]
        return as_text(next_cursor), page_rows

    async def heartbeat(self, *, now: int, scrub_every_ms: int, scrub_page: int) -> tuple[str, int, str]:
        """The table's generation ('' : none), the sum of its row hashes and the newest log entry's id, after
        one step of the shared scrub."""
        generation, checksum, last = await self.run(
            "heartbeat",
            [keys.GENERATION, keys.CHECK, keys.IDS, keys.ROWS, keys.LOG],
            [now, scrub_every_ms, scrub_page, self.log_kept, keys.STATE_PREFIX],
        )
        try:
            total = int(checksum)
        except ValueError:
            raise MalformedRow(
                f"the table check's sum ({keys.CHECK}) is {as_text(checksum)[:40]!r}, not a whole number: "
                "this snapshot cannot be checked against the table (a write that bypassed the scripts)"
            ) from None
        return as_text(generation), total, as_text(last)

    # --- rollouts: lua/rollout_version, promote_candidate, abort_rollout ---------------------------------

    async def rollout_version(
        self,
        logical_id: str,
        digest: str,
        name: str,
        path: str,
        base: str,
        base_print: str,
        weight: int,
        split: str,
        *,
        now: int,
    ) -> RolloutChange:
        """DIGEST becomes LOGICAL_ID's candidate at WEIGHT basis points, its requests split by SPLIT
        (DIGEST, NAME, PATH, BASE all '': the running rollout's weight changes; SPLIT '': the running
        rollout's, or the default for a new one)."""
        version = [digest, name, path, base]
        kept = [self.log_kept, keys.HISTORY_KEPT]
        code, epoch, now_weight, *split_now = await self.run_acked(
            "rollout_version",
            _table_keys(logical_id),
            [logical_id, *version, now, *kept, base_print, weight, split],
        )
        changed = raise_for(code, logical_id, digest, base) is Code.CHANGED
        return RolloutChange(changed, int(epoch), int(now_weight), as_text(split_now[0]) if split_now else "")

    async def promote_candidate(self, logical_id: str, digest: str, *, now: int) -> Change:
        """The candidate (DIGEST or a prefix of it; '' : whichever runs) becomes current under a new epoch."""
        code, epoch, promoted = await self.run_acked(
            "promote_candidate",
            _table_keys(logical_id, versions=False),
            [logical_id, now, self.log_kept, keys.HISTORY_KEPT, digest],
        )
        raise_for(code, logical_id, digest)
        return Change(changed=True, epoch=int(epoch), digest=as_text(promoted))

    async def abort_rollout(self, logical_id: str, digest: str, reason: str, *, now: int) -> Change:
        """Drop the candidate (DIGEST or a prefix of it; '' : whichever runs); REASON goes into the
        history."""
        code, epoch, aborted = await self.run_acked(
            "abort_rollout",
            _table_keys(logical_id, versions=False),
            [logical_id, now, self.log_kept, keys.HISTORY_KEPT, digest, reason],
        )
        raise_for(code, logical_id, digest)
        return Change(changed=True, epoch=int(epoch), digest=as_text(aborted))

    # --- the rollout gate: lua/take_gate_turn, renew_gate, release_gate, add_rollout_counts -------------

    async def take_gate_turn(
        self, logical_id: str, digest: str, gateway_id: str, *, now: int, ttl_ms: int, interval_ms: int
    ) -> tuple[Code, str, int, int]:
        """Ask for the gate of LOGICAL_ID's rollout of DIGEST: CHANGED (GATEWAY_ID holds it, a round is
        due), UNCHANGED (it holds it, none due) or LEASED (another holds it); the holder, its lease's
        expiry and the last round's start (ms)."""
        code, holder, until, round_ms = await self.run(
            "take_gate_turn",
            [keys.rollout_gate(logical_id, digest)],
            [gateway_id, now, ttl_ms, interval_ms],
        )
        return code_of(code), as_text(holder, "replace"), int(until), int(round_ms)

    async def renew_gate(
        self, logical_id: str, digest: str, gateway_id: str, *, now: int, ttl_ms: int, interval_ms: int
    ) -> bool:
        """GATEWAY_ID, auditing, keeps the gate of LOGICAL_ID's rollout of DIGEST for TTL_MS more, asking
        for no round; False: it does not hold it (nothing written)."""
        code = await self.run(
            "renew_gate", [keys.rollout_gate(logical_id, digest)], [gateway_id, now, ttl_ms, interval_ms]
        )
        return code_of(code) is Code.CHANGED

    async def release_gate(self, logical_id: str, digest: str, gateway_id: str) -> bool:
        """GATEWAY_ID lets go of the gate of LOGICAL_ID's rollout of DIGEST; False: it did not hold it."""
        code = await self.run("release_gate", [keys.rollout_gate(logical_id, digest)], [gateway_id])
        return code_of(code) is Code.CHANGED

    async def add_rollout_counts(
        self, logical_id: str, digest: str, amounts: Mapping[str, int], *, ttl_ms: int
    ) -> None:
        """Add AMOUNTS (field -> a whole number >= 0) to the fleet-wide counts of LOGICAL_ID's rollout of
        DIGEST, which live on for TTL_MS after."""
        pairs = [part for field, amount in sorted(amounts.items()) for part in (field, amount)]
        code = await self.run(
            "add_rollout_counts", [keys.rollout_counts(logical_id, digest)], [ttl_ms, len(amounts), *pairs]
        )
        if code_of(code) is not Code.CHANGED:
            raise EpochTableError(f"add_rollout_counts returned unexpected code {int(code)}")

    # --- replicas: lua/record_loaded, acquire_lock, release_lock ------------------------------------------

    async def record_loaded(self, replica: str, loaded: Mapping[str, str], ttl_ms: int) -> bool:
        """What REPLICA has loaded (name -> root), for TTL_MS; True when it changed (a hint went out)."""
        await self.redis.sadd(keys.REPLICAS, replica)
        doc = json.dumps(loaded, sort_keys=True, separators=(",", ":"))
        code = await self.run(
            "record_loaded",
            [keys.replica_loaded(replica)],
            [replica, doc, ttl_ms, keys.HINTS, keys.REPLICA_HINT_PREFIX],
        )
        return code_of(code) is Code.CHANGED

    async def acquire_lock(self, logical_id: str, name: str, replica: str, token: str, ttl_ms: int) -> bool:
        """The single-flight lock for loading NAME on REPLICA, held by TOKEN (also when it already was)."""
        got = await self.run("acquire_lock", [keys.load_lock(logical_id, name, replica)], [token, ttl_ms])
        return int(got) == 1

    async def release_lock(self, logical_id: str, name: str, replica: str, token: str) -> bool:
        """The load lock dropped, if TOKEN still held it."""
        released = await self.run("release_lock", [keys.load_lock(logical_id, name, replica)], [token])
        return int(released) == 1

    # --- leases: lua/acquire_lease, refresh_leases, begin_unload, end_unload --------------------------------

    async def acquire_lease(self, replica: str, name: str, gateway_id: str, *, now: int, ttl_ms: int) -> bool:
        """GATEWAY_ID leases NAME on REPLICA until NOW + TTL_MS; False while NAME is being unloaded."""
        code = await self.run("acquire_lease", [keys.leases(replica)], [name, gateway_id, now, ttl_ms])
        return code_of(code) is Code.CHANGED

    async def refresh_leases(
        self,
        replica: str,
        gateway_id: str,
        used: Mapping[str, int],
        keep: set[str],
        *,
        now: int,
        ttl_ms: int,
        since: int,
    ) -> None:
        """Share each name's last use in USED, keep the leases of KEEP alive, drop GATEWAY_ID's other leases
        on REPLICA written before SINCE."""
        triples = [part for name, at in sorted(used.items()) for part in (name, at, int(name in keep))]
        await self.run(
            "refresh_leases",
            [keys.leases(replica), keys.last_use(replica)],
            [gateway_id, now, ttl_ms, since, len(used), *triples],
        )

    async def begin_unload(
        self, replica: str, name: str, gateway_id: str, *, now: int, claim_ms: int, force: bool
    ) -> tuple[Code, int]:
        """Claim NAME on REPLICA for unloading: CHANGED (claimed), LEASED or UNLOADING, and the live
        leases (when forced, the ones overridden)."""
        code, live = await self.run(
            "begin_unload", [keys.leases(replica)], [name, now, claim_ms, int(force), gateway_id]
        )
        return code_of(code), int(live)

    async def end_unload(self, replica: str, name: str, *, unloaded: bool) -> None:
        """The unload of NAME on REPLICA is over: its claim goes (and, when UNLOADED, its leases and its
        last use)."""
        await self.run("end_unload", [keys.leases(replica), keys.last_use(replica)], [name, int(unloaded)])


def _raw(value: str) -> bytes:
    """A string read with ``surrogateescape`` as the bytes Redis held."""
    return value.encode(errors="surrogateescape")
