"""``kvgate gc``: remove store directories nothing needs any more.

A version ``<store>/<digest>/`` (a directory, or an object store's manifest and files) is kept when any
of these holds, and removed otherwise:

- ``current``: it is some logical ID's current version;
- ``candidate``: it is some logical ID's rollout candidate (``kvgate rollout``);
- ``recent``: it is among some logical ID's last ``keep_last`` published versions;
- ``was-current``: some logical ID had it current within the retention period (its history; an entry
  that is not one, written by hand, is skipped and counted in ``Report.malformed_history``);
- ``loaded``: a replica lists it (the listings kvgates record in Redis, and any live listing given);
- ``young``: it was written, or published again, within the retention period (the directory's mtime:
  ``AdapterStore.ingest`` touches an existing directory when it publishes the same bytes again).

Removal is safe against a concurrent publish, which writes the store first and the table second:

1. each removable directory is renamed away (``.gc-<digest>-<random>``, atomic; in an object store its
   manifest is deleted, ``adapters.gc_trash``): from then on a publish of the same bytes finds no
   version and writes a fresh one, which the table then points at;
2. then everything above is read again, once for all of them (the table, the listings, each directory's
   mtime). A publish that found a directory before the rename has touched it (``young``) or has written
   the table (``current``): the directory is put back (or, if a publish made a fresh copy meanwhile, the
   copy stays);
3. then the digest's version records are dropped under every logical ID (``lua/forget_version.lua``,
   refused when it is current), so no rollback can point the table at bytes that are gone: a rollback
   that ran before was refused there (the directory is put back), one after finds no such version;
4. only then is the renamed directory deleted.

It also removes what publishes killed half way left (their staging, older than the retention period:
``adapters.gc_leftovers``).

What remains is a publish that found the directory more than the retention period before it writes the
table: keep the retention far above how long a publish takes (seconds). In an object store the files
are shared with a fresh copy, so they are deleted only while no manifest is back; a publish that writes
its manifest between that check and the deletion leaves a version whose files are gone: its loads fail
verification on the agent (refused, counted), never served. A kvgate whose snapshot lags the
table may still try to load a version gc just removed (its ``was-current`` time is within the retention,
so only with a retention shorter than ``reconcile_interval``): that load fails, nothing is mixed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.adapters.gc_leftovers import Leftover, leftovers, remove
from gateway.adapters.gc_trash import Trash, listed
from gateway.adapters.objstore import ObjectStore
from gateway.adapters.store import AdapterStore
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import forget_version, read_ids, read_versions

_DIGEST = re.compile(r"[0-9a-f]{64}")
_NAME_DIGEST = re.compile(r"@([0-9a-f]{16,64})$")

Listings = Mapping[str, Mapping[str, str]]
"""Replica URL -> {adapter name: root}, as replicas list them."""


@dataclass(frozen=True, slots=True)
class Policy:
    keep_last: int  # per logical ID, at least 1
    retention_s: float


@dataclass(frozen=True, slots=True)
class Entry:
    digest: str
    path: Path | str
    age_s: float
    bytes: int
    kept_because: tuple[str, ...]  # empty: removable

    def to_json(self) -> dict[str, object]:
        return {"digest": self.digest, "path": str(self.path), "age_s": round(self.age_s, 1),
                "bytes": self.bytes, "kept_because": list(self.kept_because)}  # fmt: skip


@dataclass(slots=True)
class Report:
    entries: list[Entry]
    removed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)  # found needed again after the rename: put back
    leftovers: list[Leftover] = field(default_factory=list)  # killed publishes' staging: removed too
    malformed_history: list[str] = field(default_factory=list)  # history entries skipped, and why


async def collect(
    table: EpochTable,
    store: AdapterStore | ObjectStore,
    policy: Policy,
    listings: Listings | None = None,
    *,
    now: float | None = None,
    malformed: list[str] | None = None,
) -> list[Entry]:
    """Every store directory with the reasons it is kept (none: removable), oldest first; why each history
    entry that is not one was skipped goes into ``malformed``."""
    now = time.time() if now is None else now
    needed = await _needed(table, policy, {} if listings is None else listings, now, malformed)
    entries = []
    for item in listed(store, _DIGEST.fullmatch):
        age = now - item.modified
        reasons = [*needed.get(item.digest, ()), *_prefix_reasons(needed, item.digest)]
        if age < policy.retention_s:
            reasons.append("young")
        entries.append(Entry(item.digest, item.path, age, item.bytes, tuple(sorted(set(reasons)))))
    return sorted(entries, key=lambda e: -e.age_s)


async def sweep(
    table: EpochTable,
    store: AdapterStore | ObjectStore,
    policy: Policy,
    listings: Listings | None = None,
    *,
    dry_run: bool = False,
    now: float | None = None,
) -> Report:
    """``collect``, then remove the removable directories (unless ``dry_run``) by the steps above: all of
    them renamed away, one second read, then each one put back or forgotten and deleted."""
    listings = {} if listings is None else listings
    malformed: list[str] = []
    report = Report(await collect(table, store, policy, listings, now=now, malformed=malformed))
    report.malformed_history = malformed
    report.leftovers = leftovers(store, policy.retention_s, time.time() if now is None else now)
    if dry_run:
        return report
    for leftover in report.leftovers:
        remove(store, leftover)
    trash = Trash(store)
    for entry in report.entries:
        if not entry.kept_because:
            trash.take(entry.digest, entry.path)
    if not trash.taken:
        return report
    now = time.time() if now is None else now
    needed = await _needed(table, policy, listings, now)  # the second read
    records: dict[str, list[str]] = {}  # digest -> the logical IDs that have a record of it
    for logical_id in await read_ids(table):
        for record in await read_versions(table, logical_id):
            records.setdefault(record.digest, []).append(logical_id)
    for digest in list(trash.taken):
        if await _still_removable(table, policy, needed, records.get(digest, []), digest, trash, now):
            if trash.delete(digest):
                report.removed.append(digest)
                continue
        else:
            trash.put_back(digest)
        report.restored.append(digest)
    return report


async def _still_removable(
    table: EpochTable,
    policy: Policy,
    needed: dict[str, set[str]],
    recorded_by: list[str],
    digest: str,
    trash: Trash,
    now: float,
) -> bool:
    if needed.get(digest) or _prefix_reasons(needed, digest) or trash.age(digest, now) < policy.retention_s:
        return False
    for logical_id in recorded_by:
        if not await forget_version(table, logical_id, digest):
            return False  # a rollback made it current just now
    return True


async def _needed(
    table: EpochTable, policy: Policy, listings: Listings, now: float, malformed: list[str] | None = None
) -> dict[str, set[str]]:
    """digest (or a listed name's digest prefix, 16+ hex) -> why it is needed."""
    needed: dict[str, set[str]] = {}

    def need(digest: str, why: str) -> None:
        needed.setdefault(digest, set()).add(why)

    view = await table.read_all()
    for state in view.states.values():
        need(state.digest, "current")
        if state.candidate is not None:
            need(state.candidate.digest, "candidate")
    since_ms = (now - policy.retention_s) * 1000
    for logical_id in await read_ids(table):
        for record in (await read_versions(table, logical_id))[: policy.keep_last]:
            need(record.digest, "recent")
        newer_at: float = float("inf")  # the history is newest first: each event's digest was current until
        for event in await table.read_history(logical_id, malformed):  # the next newer event
            if event.get("role") == "candidate":  # a rollout's event: that version was not current
                continue
            if newer_at > since_ms:
                need(str(event.get("digest", "")), "was-current")
            newer_at = float(event.get("at_ms", 0))
    recorded = await table.read_loaded()
    for listing in [*recorded.values(), *listings.values()]:
        for name, root in listing.items():
            base_name = Path(root).name
            if _DIGEST.fullmatch(base_name):
                need(base_name, "loaded")
            if match := _NAME_DIGEST.search(name):
                need(match.group(1), "loaded")
    return needed


def _prefix_reasons(needed: dict[str, set[str]], digest: str) -> list[str]:
    """Reasons held by a shorter prefix of DIGEST (a versioned name carries 16 hex of it)."""
    return [why for key, whys in needed.items() if key != digest and digest.startswith(key) for why in whys]
