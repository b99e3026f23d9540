"""Fingerprinting each replica's base model: by bytes where kvgate can read them, by behaviour always.

The rule that compares two prints is ``core.base_print``'s: where both have bytes the bytes decide; else
the behaviour (the probe's top logprobs within a tolerance, a first token differing only at a near-tie).

Bytes (``fleet.base_bytes``): where ``base_model_dirs`` maps the base's served name to a directory, or
the root the listing reports is a readable directory here. Read once per incarnation (a ``stat`` per file
when nothing changed): they are what the replica loaded when it started. Files changed under a running
replica are logged (it serves other weights after its next restart, when they are read again).

Behaviour (``core.base_print``): the first-token top logprobs after the fixed probe prompts, ``PROBE_RUNS``
times, each in a fresh cache namespace (cold). A print that differs from what the replica is expected to
be (its print before a restart, the base's reference, the prints of the current versions of its base) is
taken again, up to
``CONFIRM_PROBES`` prints ``CONFIRM_WAIT_S`` apart, and held to differ only when every one of them
differs: one probe under load is never acted on.

Both are taken when a replica first appears and again after every restart it is seen to make: it became
reachable after being down, or its process start time changed (``process_start_time_seconds`` in its
``/metrics``, checked every poll), or, on a replica without a start time, its listing lost every adapter
(``ReplicaPool`` notices these). Until one of them is taken the replica serves no version published with
a print; with its bytes read it serves every version whose print has the same bytes at once, and the
others once its behaviour is taken.

When a replica's print changes it is another base: versions published for the old one are not eligible
there any more (the scheduler), ``fleet.loader`` unloads them, and ``mismatches`` says why (status,
``kvgate_base_mismatched_versions``). Versions published without a print (tables from before prints), or
with a ``bp1`` print (greedy text, from before today's probe), are held to the first print this kvgate took
of their base (``reference``). ``disagreements`` says where replicas serving one base name disagree
(bytes, or behaviour while the bytes agree): ``/kvgate/status``, ``kvgate status``, a count on
``/healthz``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from gateway.core import base_print
from gateway.core.errors import MalformedAnswer
from gateway.core.model import VersionState
from gateway.core.wire import cold_salt
from gateway.fleet.backends import AdapterListing, BackendDialect, answers
from gateway.fleet.base_bytes import BaseBytes
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

MAX_FAILURES = 3  # transient probe failures per incarnation before it counts as unprintable
CONFIRM_WAIT_S = 1.0  # between the prints that confirm a difference (``core.base_print.CONFIRM_PROBES``)
RETRY_UNPRINTABLE_S = 10.0
"""An incarnation that could not be fingerprinted is probed again this often: a replica answering 200
``text/html`` for a while after a restart is fingerprinted once it answers the probe again."""


def mismatch(pool: ReplicaPool, replica: Replica, version: VersionState) -> str | None:
    """Why ``replica``, which serves the version's base by name and has been fingerprinted, is another
    base than ``version`` was published for (None: it is the same, or it cannot be told yet)."""
    if replica.base != version.base:
        return None
    return base_print.differs(pool.expected_print(version), replica.base_print)


def mismatched(pool: ReplicaPool, replica: Replica, versions: Iterable[VersionState]) -> dict[str, str]:
    """Logical ID -> why ``replica`` may not serve its current version: another base under its name."""
    found = {v.logical_id: mismatch(pool, replica, v) for v in versions}
    return {logical_id: why for logical_id, why in found.items() if why is not None}


def mismatch_report(pool: ReplicaPool, versions: Iterable[VersionState]) -> list[dict[str, str]]:
    """Every (replica, logical ID) kept apart because the replica is another base: for ``kvgate status``."""
    versions = list(versions)
    return [
        {"replica": replica.url, "logical_id": logical_id, "reason": reason,
         "replica_print": base_print.short(replica.base_print) or ""}
        for replica in pool.replicas
        for logical_id, reason in mismatched(pool, replica, versions).items()
    ]  # fmt: skip


def base_status(pool: ReplicaPool, replica: Replica, versions: Iterable[VersionState]) -> dict[str, Any]:
    """What ``/kvgate/status`` says of a replica's base: identity, fingerprints, and what it may not serve."""
    prints = replica.prints
    return {
        "base_identity": replica.base,
        "base_print": base_print.short(replica.base_print),
        "base_print_full": replica.base_print,
        "base_bytes_digest": prints.bytes_digest,
        "base_bytes_root": prints.bytes_root,
        "base_unprintable": prints.unprintable or None,
        "base_print_previous": base_print.short(prints.previous),
        "base_print_changed": prints.changed_reason or None,
        "restarts_seen": max(replica.incarnation - 1, 0),
        "last_restart": replica.restart_reason or None,
        "base_mismatch": mismatched(pool, replica, versions),
    }


def disagreements(pool: ReplicaPool) -> list[dict[str, Any]]:
    """Where healthy replicas serving one base identity disagree, each against the first one listed:
    ``kind`` "bytes" or "behaviour" (two bases: versions published for one are not served by the other),
    or "behaviour-only" (the bytes agree, so they are one base, but the probe says otherwise: a server
    that is not deterministic enough for the behaviour rule, worth knowing where bytes cannot be read)."""
    found: list[dict[str, Any]] = []
    first: dict[str, Replica] = {}
    for replica in pool.healthy():
        if replica.base is None or replica.base_print is None:
            continue
        ref = first.setdefault(replica.base, replica)
        theirs, ours = base_print.decode(ref.base_print or ""), base_print.decode(replica.base_print)
        if ref is replica or theirs is None or ours is None:
            continue
        kind, why = "", theirs.difference(ours) if theirs.comparable(ours) else None
        if why is not None:
            kind = "bytes" if theirs.bytes and ours.bytes else "behaviour"
        elif theirs.bytes and ours.bytes and (why := theirs.behaviour_difference(ours)) is not None:
            kind, why = "behaviour-only", f"the bytes agree (one base), but {why}"
        if why is not None:
            found.append({"base": replica.base, "kind": kind, "replicas": [ref.url, replica.url],
                          "prints": [base_print.short(ref.base_print), base_print.short(replica.base_print)],
                          "detail": why})  # fmt: skip
    return found


def base_directory(model_dirs: dict[str, Path], listing: AdapterListing) -> Path | None:
    """Where the files of the base a replica lists are read: ``base_model_dirs``, else its listed root."""
    name, root = listing.base_name or "", listing.base_root
    return model_dirs.get(name) or (Path(root) if root else None)


async def probe(
    session: aiohttp.ClientSession, dialect: BackendDialect, url: str, model: str, floor: float
) -> base_print.BasePrint | str:
    """The behaviour print of the server at ``url`` (the fixed prompts' first-token top logprobs, cold,
    ``PROBE_RUNS`` times), or why it cannot have one: it answered, but not with them. Connection errors
    and timeouts raise (a later try may succeed)."""
    prompts, k = list(base_print.PROBE_PROMPTS), base_print.TOP_K
    runs = []
    for _ in range(base_print.PROBE_RUNS):
        body: dict[str, object] = {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                   "logprobs": k + base_print.TOP_SPARE}  # fmt: skip
        dialect.set_cache_namespace(body, cold_salt())
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status >= 500:
                response.raise_for_status()
            answer = await response.read()
            if response.status != 200:
                return f"the probe got {response.status}: {answers.reason_of(answer, response.status)[:200]}"
        try:
            runs.append(answers.probe_tops(answers.json_of(answer), len(prompts), k))
        except MalformedAnswer as exc:
            return f"the probe's answer is malformed: {exc.reason}"
    return base_print.take(runs, floor)


class BasePrints:
    """Takes and keeps every replica's base fingerprints (the only writer of ``Replica.prints``)."""

    def __init__(
        self,
        pool: ReplicaPool,
        *,
        floor: float,
        model_dirs: dict[str, Path],
        bytes_: BaseBytes,
        on_change: Callable[[Replica], None] = lambda replica: None,
    ) -> None:
        self.pool = pool
        self.floor = floor
        self.model_dirs = model_dirs
        self.bytes = bytes_
        self.on_change = on_change
        self.retry_unprintable = RETRY_UNPRINTABLE_S
        self.confirm_wait = CONFIRM_WAIT_S
        self.versions: Iterable[VersionState] = ()  # the current versions (``watch``): confirmed against

    def watch(self, metrics: Metrics, versions: Iterable[VersionState]) -> None:
        """Report to ``metrics`` (print changes, and the versions each replica may not serve), and
        fingerprint a replica again as soon as a refresh notices it restarted."""
        for replica in self.pool.replicas:
            metrics.base_mismatched.labels(replica.url).set_function(
                functools.partial(lambda r: len(mismatched(self.pool, r, versions)), replica)
            )
        self.on_change = lambda replica: metrics.base_print_changes.labels(replica.url).inc()
        self.pool.after_restart = self.check
        self.versions = versions

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(replica) for replica in self.pool.healthy()))

    async def check(self, replica: Replica) -> None:
        """Notice a restart by its start time, then take what is missing: the bytes digest of this
        incarnation (cached: a ``stat`` per file when nothing changed) and its behaviour print."""
        if replica.listing.base_name is None:
            return
        if not await self._check_start_time(replica):
            return
        await self._check_bytes(replica)
        prints = replica.prints
        retry = bool(prints.unprintable) and time.monotonic() >= prints.retry_at
        if prints.incarnation == replica.incarnation and (
            prints.behaviour or (prints.unprintable and not retry)
        ):
            return
        try:
            taken = await self._confirmed(replica, await self._probe(replica))
        except (aiohttp.ClientError, TimeoutError) as exc:
            prints.failures = prints.failures + 1 if prints.incarnation == replica.incarnation else 1
            prints.incarnation = replica.incarnation
            prints.behaviour = None
            if prints.failures >= MAX_FAILURES:
                self._no_print(replica, f"the probe failed {prints.failures} times: {exc!r}")
            return
        if isinstance(taken, str):
            self._no_print(replica, taken)
            return
        prints.behaviour, prints.incarnation, prints.failures, prints.unprintable = (
            taken.encode(), replica.incarnation, 0, ""
        )  # fmt: skip
        self._identify(replica)

    async def _probe(self, replica: Replica) -> base_print.BasePrint | str:
        model = replica.listing.base_name or ""
        return await probe(self.pool.session, self.pool.dialect, replica.url, model, self.floor)

    async def _confirmed(
        self, replica: Replica, taken: base_print.BasePrint | str
    ) -> base_print.BasePrint | str:
        """``taken``, or, when its behaviour differs from what the replica is expected to be and the bytes
        do not decide, the first of up to ``CONFIRM_PROBES`` prints that does not differ (the last one
        when all differ: the difference is confirmed)."""
        for attempt in range(1, base_print.CONFIRM_PROBES):
            if isinstance(taken, str):
                return taken
            why = self._unexpected(replica, taken)
            if why is None:
                return taken
            log.info("base print %d of %s differs (%s): taking another before acting on it", attempt,
                     replica.url, why)  # fmt: skip
            await asyncio.sleep(self.confirm_wait)
            taken = await self._probe(replica)
        return taken

    def _unexpected(self, replica: Replica, taken: base_print.BasePrint) -> str | None:
        """Why a behaviour print differs from a print this replica is expected to match where the bytes do
        not decide: its print before, its base's reference, the current versions' of its base."""
        prints = replica.prints
        bytes_ = prints.bytes_digest if prints.bytes_incarnation == replica.incarnation else ""
        expected = {prints.identity or "", self.pool.base_references.get(replica.base or "", "")}
        expected |= {self.pool.expected_print(v) for v in self.versions if v.base == replica.base}
        for encoded in sorted(expected - {""}):
            want = base_print.decode(encoded)
            if want is None or (want.bytes and bytes_):
                continue  # the bytes decide: another probe tells nothing
            why = want.behaviour_difference(taken)
            if why is not None:
                return why
        return None

    def _identify(self, replica: Replica) -> None:
        """Put this incarnation's bytes and behaviour together as the replica's print; a print that
        differs from the one before (a restart) makes it another base."""
        prints, base = replica.prints, replica.base or ""
        incarnation = replica.incarnation
        behaviour = base_print.decode(prints.behaviour or "") if prints.incarnation == incarnation else None
        bytes_ = prints.bytes_digest if prints.bytes_incarnation == incarnation else None
        combined = base_print.with_bytes(behaviour, bytes_)
        if combined is None:
            return
        before, encoded = prints.identity, combined.encode()
        prints.identity, prints.identity_incarnation = encoded, incarnation
        if combined.behaviour:
            self.pool.base_references.setdefault(base, encoded)
        difference = base_print.differs(before or "", encoded)
        if difference is not None:
            prints.previous, prints.changed_reason = (
                before,
                (f"base fingerprint changed after a restart ({replica.restart_reason}): {difference}"),
            )
            log.error("replica %s now serves another base under %r: %s", replica.url, base,
                      prints.changed_reason)  # fmt: skip
            self.on_change(replica)
        if encoded != before:
            log.info("base of %s (%s) fingerprinted: %s", replica.url, base, base_print.short(encoded))

    def _no_print(self, replica: Replica, reason: str, *, retry_after: float | None = None) -> None:
        """This incarnation has no print, for REASON (logged once while it stays); it is probed again
        after ``retry_unprintable`` seconds (RETRY_AFTER: sooner)."""
        prints = replica.prints
        if reason != prints.unprintable or prints.incarnation != replica.incarnation:
            log.warning("cannot fingerprint the base of %s: %s", replica.url, reason)
        prints.incarnation, prints.behaviour, prints.unprintable = replica.incarnation, None, reason
        wait = self.retry_unprintable if retry_after is None else retry_after
        prints.retry_at = time.monotonic() + wait

    async def _check_start_time(self, replica: Replica) -> bool:
        """Notice a restart by the process start time; False when ``/metrics`` has a start time that is
        not a number: a restart could not be noticed, so the replica has no print until it reads well
        again (then its base is fingerprinted again)."""
        try:
            async with self.pool.session.get(f"{replica.url}/metrics") as response:
                text = await response.read() if response.status == 200 else b""
        except (aiohttp.ClientError, TimeoutError):
            return True
        prints = replica.prints
        try:
            started = answers.start_time(text)
        except MalformedAnswer as exc:
            self._no_print(replica, f"its /metrics is malformed, restarts cannot be seen: {exc.reason}",
                           retry_after=0.0)  # fmt: skip
            prints.start_time = None
            return False
        if started is None:
            return True
        known, prints.start_time = prints.start_time, started
        noticed = prints.incarnation != replica.incarnation  # a restart already noticed, not printed yet
        if known is not None and abs(started - known) > 1e-3 and not noticed:
            replica.restarted("its process start time changed")
        return True

    async def _check_bytes(self, replica: Replica) -> None:
        """Read the base's bytes: they identify an incarnation when it is first seen; a change later is
        logged (the replica loaded its files when it started: it serves other weights after a restart)."""
        directory = base_directory(self.model_dirs, replica.listing)
        if directory is None:
            return
        digest = await self.bytes.digest_async(directory)  # None: not a readable model directory here
        prints = replica.prints
        if prints.bytes_incarnation != replica.incarnation:
            prints.bytes_digest, prints.bytes_root = digest, str(directory) if digest else None
            prints.bytes_incarnation, prints.bytes_on_disk = replica.incarnation, digest
            self._identify(replica)
            return
        if digest and prints.bytes_on_disk and digest != prints.bytes_on_disk:
            log.warning(
                "the base files of %s under %s changed (%s -> %s): it serves other weights after its next "
                "restart", replica.url, directory, prints.bytes_on_disk[:16], digest[:16],
            )  # fmt: skip
        prints.bytes_on_disk = digest or prints.bytes_on_disk
