"""Publishing a version: validate and store the bytes, then point the logical ID at them.

Redis must answer (and take a write) before the store is touched, so an unreachable table stores
nothing. The store write is atomic and content-addressed; the epoch table write is one Lua script. If
that script fails, the directory this publish created is removed again, unless the table may hold the
version after all (the answer was lost, or Redis cannot say): an unreferenced directory may be left
behind, never a referenced one removed (short of a concurrent publish of the very same bytes under
another logical ID in that instant, which it cannot see).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gateway.adapters.fit import check_fit
from gateway.adapters.objstore import ObjectArtifact, ObjectStore
from gateway.adapters.store import AdapterStore, Progress, StoredArtifact
from gateway.core.base_print import current as current_scheme
from gateway.core.base_print import prints_match
from gateway.core.identity import ManifestEntry, check_logical_id, versioned_name
from gateway.core.model import Change, RolloutChange
from gateway.table.epoch_table import EpochTable
from gateway.table.rollouts import split_of, start_rollout

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Published:
    logical_id: str
    digest: str
    name: str
    path: Path | str  # the store's directory, or its s3:// location
    change: Change


async def publish_adapter(
    table: EpochTable,
    store: AdapterStore | ObjectStore,
    logical_id: str,
    adapter_dir: Path,
    base: str,
    *,
    manifest: list[ManifestEntry] | None = None,
    progress: Progress | None = None,
    base_print: str = "",
    base_dir: Path | None = None,
) -> Published:
    """MANIFEST: ``store.scan(adapter_dir)`` when the caller has checked the directory already; PROGRESS:
    called with each chunk's bytes as the store copies them; BASE_PRINT: the fingerprint of BASE
    (``core.base_print``), '' when none could be taken. The same bytes for a base the current print
    matches keep that print: a fingerprint taken again (its logprobs move by noise) changes nothing.
    BASE_DIR: where the base's files are read, when they can be: an adapter that cannot fit them is
    refused before anything is written (``adapters/fit.py``)."""

    async def write(digest: str, name: str, path: str) -> Change:
        current = await table.read_state(logical_id)
        printed = base_print
        if current is not None and (current.digest, current.base) == (digest, base):
            kept = current.base_print
            printed = kept if current_scheme(kept) and prints_match(kept, base_print) else base_print
        return await table.publish(logical_id, digest, name, path, base, printed)

    digest, name, path, change = await _store_then(
        table, store, logical_id, adapter_dir, base, manifest, progress, write, base_dir
    )
    return Published(logical_id, digest, name, path, change)


@dataclass(frozen=True, slots=True)
class RolledOut:
    logical_id: str
    digest: str
    name: str
    path: Path | str  # the store\'s directory, or its s3:// location
    change: RolloutChange


async def rollout_adapter(
    table: EpochTable,
    store: AdapterStore | ObjectStore,
    logical_id: str,
    adapter_dir: Path,
    base: str,
    weight: int,
    *,
    manifest: list[ManifestEntry] | None = None,
    progress: Progress | None = None,
    base_print: str = "",
    split: str | None = None,
    base_dir: Path | None = None,
) -> RolledOut:
    """Like ``publish_adapter`` (an adapter that cannot fit BASE_DIR's base refused alike), but the bytes
    become the ID's rollout candidate at WEIGHT basis points (``lua/rollout_version.lua``) beside its
    current version, split by SPLIT (None: the default)."""
    split_of(split)  # refused before anything is stored

    async def write(digest: str, name: str, path: str) -> RolloutChange:
        return await start_rollout(table, logical_id, digest, name, path, base, weight, base_print, split)

    digest, name, path, change = await _store_then(
        table, store, logical_id, adapter_dir, base, manifest, progress, write, base_dir
    )
    return RolledOut(logical_id, digest, name, path, change)


async def _store_then(
    table: EpochTable,
    store: AdapterStore | ObjectStore,
    logical_id: str,
    adapter_dir: Path,
    base: str,
    manifest: list[ManifestEntry] | None,
    progress: Progress | None,
    write: Callable[[str, str, str], Awaitable[T]],
    base_dir: Path | None = None,
) -> tuple[str, str, Path | str, T]:
    """The store first, then the table's WRITE (digest, versioned name, path); the stored copy removed
    again when the write failed and the table cannot hold it. An adapter that cannot fit the base (its
    files at BASE_DIR) is refused before either."""
    check_logical_id(logical_id)
    if manifest is None:
        manifest = store.scan(adapter_dir)
    check_fit(adapter_dir, base_dir, base)
    await table.ensure_generation()  # Redis answers and takes writes: checked before the store is written
    artifact = store.ingest(adapter_dir, manifest, progress)
    name = versioned_name(logical_id, artifact.digest)
    try:
        change = await write(artifact.digest, name, str(artifact.path))
    except Exception:
        if artifact.created and not await _may_be_recorded(table, logical_id, base, artifact.digest):
            _remove(store, artifact)
        raise
    return artifact.digest, name, artifact.path, change


def _remove(store: AdapterStore | ObjectStore, artifact: StoredArtifact | ObjectArtifact) -> None:
    if isinstance(store, ObjectStore):
        assert isinstance(artifact, ObjectArtifact)
        store.remove(artifact)
        return
    assert isinstance(artifact, StoredArtifact)
    store.remove(artifact)


async def _may_be_recorded(table: EpochTable, logical_id: str, base: str, digest: str) -> bool:
    try:
        return await table.has_version(logical_id, base, digest)
    except Exception:  # Redis cannot say: keep the bytes, the table may point at them
        return True
