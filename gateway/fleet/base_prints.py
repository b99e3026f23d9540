"""Fingerprinting each replica's base model: by behaviour always, by bytes where kvgate can read them.

Behaviour (``core.base_print``): the fixed probe, greedy with token logprobs, ``PROBE_RUNS`` times, each
in a fresh cache namespace (cold), taken when a replica first appears and again after every restart it
is seen to make: it became reachable after being down, or its process start time changed
(``process_start_time_seconds`` in its ``/metrics``, checked every poll), or, on a replica without a start
time, its listing lost every adapter (``ReplicaPool`` notices these). Until the new print is taken the
replica serves no version published with one.

Bytes (``fleet.base_bytes``): where ``base_model_dirs`` maps the base's served name to a directory, or
the root the listing reports is a readable directory here. Recorded and reported (and a change of the
files under a running replica is logged: it serves other weights after its next restart); routing
decides on the behaviour print, which every server has.

When a replica's print changes it is another base: versions published for the old one are not eligible
there any more (the scheduler), ``fleet.loader`` unloads them, and ``mismatches`` says why (status,
``kvgate_base_mismatched_versions``). Versions published without a print (tables from before prints)
are held to the first print this kvgate took of their base (``reference``): a replica that differs from
it is another base for them too.
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
from gateway.fleet.backends import BackendDialect, answers
from gateway.fleet.base_bytes import BaseBytes
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

MAX_FAILURES = 3  # transient probe failures per incarnation before it counts as unprintable
RETRY_UNPRINTABLE_S = 10.0
"""An incarnation that could not be fingerprinted is probed again this often: a replica answering 200
``text/html`` for a while after a restart is fingerprinted once it answers the probe again."""


def mismatch(pool: ReplicaPool, replica: Replica, version: VersionState) -> str | None:
    """Why ``replica``, which serves the version's base by name and has been fingerprinted, is another
    base than ``version`` was published for (None: it is the same, or it cannot be told yet)."""
    if replica.base != version.base or replica.base_print is None:
        return None
    return base_print.mismatch(pool.expected_print(version), replica.base_print)


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


async def probe(
    session: aiohttp.ClientSession, dialect: BackendDialect, url: str, model: str, floor: float
) -> base_print.BasePrint | str:
    """The base print of the server at ``url`` (the fixed probe, cold, ``PROBE_RUNS`` times), or why it
    cannot have one: it answered, but not with greedy text and token logprobs. Connection errors and
    timeouts raise (a later try may succeed)."""
    texts, runs = [], []
    for _ in range(base_print.PROBE_RUNS):
        body: dict[str, object] = {"model": model, "prompt": base_print.PROBE_PROMPT, "temperature": 0,
                                   "max_tokens": base_print.PROBE_TOKENS, "logprobs": 1}  # fmt: skip
        dialect.set_cache_namespace(body, cold_salt())
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status >= 500:
                response.raise_for_status()
            answer = await response.read()
            if response.status != 200:
                return f"the probe got {response.status}: {answers.reason_of(answer, response.status)[:200]}"
        try:
            text, logprobs = answers.probe_choice(answers.json_of(answer))
        except MalformedAnswer as exc:
            return f"the probe's answer is malformed: {exc.reason}"
        texts.append(text)
        runs.append(logprobs)
    if len(set(texts)) != 1:
        return "cold probe runs gave different greedy tokens (nondeterministic)"
    return base_print.take(texts[0], runs, floor)


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

    def watch(self, metrics: Metrics, versions: Iterable[VersionState]) -> None:
        """Report to ``metrics`` (print changes, and the versions each replica may not serve), and
        fingerprint a replica again as soon as a refresh notices it restarted."""
        for replica in self.pool.replicas:
            metrics.base_mismatched.labels(replica.url).set_function(
                functools.partial(lambda r: len(mismatched(self.pool, r, versions)), replica)
            )
        self.on_change = lambda replica: metrics.base_print_changes.labels(replica.url).inc()
        self.pool.after_restart = self.check

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(replica) for replica in self.pool.healthy()))

    async def check(self, replica: Replica) -> None:
        """Notice a restart by its start time, then take what is missing: the behaviour print of this
        incarnation, and the bytes digest (cached: a ``stat`` per file when nothing changed)."""
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
            taken = await probe(
                self.pool.session, self.pool.dialect, replica.url, replica.listing.base_name, self.floor
            )
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
        self._record(replica, taken.encode())

    def _no_print(self, replica: Replica, reason: str, *, retry_after: float | None = None) -> None:
        """This incarnation has no print, for REASON (logged once while it stays); it is probed again
        after ``retry_unprintable`` seconds (RETRY_AFTER: sooner)."""
        prints = replica.prints
        if reason != prints.unprintable or prints.incarnation != replica.incarnation:
            log.warning("cannot fingerprint the base of %s: %s", replica.url, reason)
        prints.incarnation, prints.behaviour, prints.unprintable = replica.incarnation, None, reason
        wait = self.retry_unprintable if retry_after is None else retry_after
        prints.retry_at = time.monotonic() + wait

    def _record(self, replica: Replica, encoded: str) -> None:
        prints, base = replica.prints, replica.base or ""
        before = prints.behaviour
        prints.behaviour, prints.incarnation, prints.failures, prints.unprintable = (
            encoded,
            replica.incarnation,
            0,
            "",
        )
        self.pool.base_references.setdefault(base, encoded)
        old = base_print.decode(before) if before else None
        new = base_print.decode(encoded)
        difference = old.difference(new) if old is not None and new is not None else None
        if difference is not None:
            prints.previous, prints.changed_reason = (
                before,
                (f"base fingerprint changed after a restart ({replica.restart_reason}): {difference}"),
            )
            log.error("replica %s now serves another base under %r: %s", replica.url, base,
                      prints.changed_reason)  # fmt: skip
            self.on_change(replica)
        log.info("base of %s (%s) fingerprinted: %s", replica.url, base, base_print.short(encoded))

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
        name, root = replica.listing.base_name or "", replica.listing.base_root
        directory = self.model_dirs.get(name) or (Path(root) if root else None)
        if directory is None:
            return
        digest = await self.bytes.digest_async(directory)  # None: not a readable model directory here
        prints = replica.prints
        known = prints.bytes_digest if prints.bytes_root == str(directory) else None
        if known and digest and digest != known:
            log.warning(
                "the base files of %s under %s changed (%s -> %s): it serves other weights after its next "
                "restart", replica.url, directory, known[:16], digest[:16],
            )  # fmt: skip
        prints.bytes_digest, prints.bytes_root = digest, str(directory) if digest else None
