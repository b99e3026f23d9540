"""``kvgate gc``: remove store directories nothing needs any more.

A directory ``<store>/<digest>/`` is kept when any of these holds, and removed otherwise:

- ``current``: it is some logical ID's current version;
- ``candidate``: it is some logical ID's rollout candidate (``kvgate rollout``);
- ``recent``: it is among some logical ID's last ``keep_last`` published versions;
- ``was-current``: some logical ID had it current within the retention period (its history);
- ``loaded``: a replica lists it (the listings kvgates record in Redis, and any live listing given);
- ``young``: it was written, or published again, within the retention period (the directory's mtime:
  ``AdapterStore.ingest`` touches an existing directory when it publishes the same bytes again).

Removal is safe against a concurrent publish, which writes the store first and the table second:

1. each removable directory is renamed away (``.gc-<digest>-<random>``, atomic): from then on a publish
   of the same bytes finds no directory and writes a fresh one, which the table then points at;
2. then everything above is read again, once for all of them (the table, the listings, each directory's
   mtime). A publish that found a directory before the rename has touched it (``young``) or has written
   the table (``current``): the directory is put back (or, if a publish made a fresh copy meanwhile, the
   copy stays);
3. then the digest's version records are dropped under every logical ID (``lua/forget_version.lua``,
   refused when it is current), so no rollback can point the table at bytes that are gone: a rollback
   that ran before was refused there (the directory is put back), one after finds no such version;
4. only then is the renamed directory deleted.

What remains is a publish that found the directory more than the retention period before it writes the
table: keep the retention far above how long a publish takes (seconds). A kvgate whose snapshot lags the
table may still try to load a version gc just removed (its ``was-current`` time is within the retention,
so only with a retention shorter than ``reconcile_interval``): that load fails, nothing is mixed.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.adapters.store import AdapterStore
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import forget_version, read_ids, read_versions

_DIGEST = re.compile(r"[0-9a-f]{64}")
_NAME_DIGEST = re.compile(r"@([0-9a-f]{16,64})$")
TRASH_PREFIX = ".gc-"

Listings = Mapping[str, Mapping[str, str]]
"""Replica URL -> {adapter name: root}, as replicas list them."""


@dataclass(frozen=True, slots=True)
class Policy:
    keep_last: int  # per logical ID, at least 1
    retention_s: float


@dataclass(frozen=True, slots=True)
class Entry:
    digest: str
    path: Path
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


async def collect(
    table: EpochTable,
    store: AdapterStore,
    policy: Policy,
    listings: Listings | None = None,
    *,
    now: float | None = None,
) -> list[Entry]:
    """Every store directory with the reasons it is kept (none: removable), oldest first."""
    now = time.time() if now is None else now
    needed = await _needed(table, policy, {} if listings is None else listings, now)
    entries = []
    for path in sorted(store.root.iterdir()) if store.root.is_dir() else []:
        if not (_DIGEST.fullmatch(path.name) and path.is_dir()):
            continue  # .incoming-* (a publish under way), .gc-* (another gc), anything else
        age = now - path.stat().st_mtime
        reasons = [*needed.get(path.name, ()), *_prefix_reasons(needed, path.name)]
        if age < policy.retention_s:
            reasons.append("young")
        entries.append(Entry(path.name, path, age, _size(path), tuple(sorted(set(reasons)))))
    return sorted(entries, key=lambda e: -e.age_s)


async def sweep(
    table: EpochTable,
    store: AdapterStore,
    policy: Policy,
    listings: Listings | None = None,
    *,
    dry_run: bool = False,
    now: float | None = None,
) -> Report:
    """``collect``, then remove the removable directories (unless ``dry_run``) by the steps above: all of
    them renamed away, one second read, then each one put back or forgotten and deleted."""
    listings = {} if listings is None else listings
    report = Report(await collect(table, store, policy, listings, now=now))
    if dry_run:
        return report
    trashed: dict[str, tuple[Path, Path]] = {}  # digest -> (its path, where it was renamed to)
    for entry in report.entries:
        if entry.kept_because:
            continue
        trash = store.root / f"{TRASH_PREFIX}{entry.digest}-{secrets.token_hex(4)}"
        try:
            os.rename(entry.path, trash)
        except FileNotFoundError:
            continue  # another gc took it
        trashed[entry.digest] = (entry.path, trash)
    if not trashed:
        return report
    now = time.time() if now is None else now
    needed = await _needed(table, policy, listings, now)  # the second read
    records: dict[str, list[str]] = {}  # digest -> the logical IDs that have a record of it
    for logical_id in await read_ids(table):
        for record in await read_versions(table, logical_id):
            records.setdefault(record.digest, []).append(logical_id)
    for digest, (path, trash) in trashed.items():
        if await _still_removable(table, policy, needed, records.get(digest, []), digest, trash, now):
            shutil.rmtree(trash)
            report.removed.append(digest)
        else:
            _put_back(trash, path)
            report.restored.append(digest)
    return report


async def _still_removable(
    table: EpochTable,
    policy: Policy,
    needed: dict[str, set[str]],
    recorded_by: list[str],
    digest: str,
    trash: Path,
    now: float,
) -> bool:
    if needed.get(digest) or _prefix_reasons(needed, digest) or now - _mtime(trash) < policy.retention_s:
        return False
    for logical_id in recorded_by:
        if not await forget_version(table, logical_id, digest):
            return False  # a rollback made it current just now
    return True


def _put_back(trash: Path, path: Path) -> None:
    try:
        os.rename(trash, path)
    except OSError:
        if not path.is_dir():
            raise
        shutil.rmtree(trash)  # a publish wrote the same bytes afresh meanwhile: that copy stays


async def _needed(table: EpochTable, policy: Policy, listings: Listings, now: float) -> dict[str, set[str]]:
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
        for event in await table.read_history(logical_id):  # the next newer event
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


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
