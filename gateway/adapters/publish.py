"""Publishing a version: validate and store the bytes, then point the logical ID at them.

Redis must answer (and take a write) before the store is touched, so an unreachable table stores
nothing. The store write is atomic and content-addressed; the epoch table write is one Lua script. If
that script fails, the directory this publish created is removed again, unless the table may hold the
version after all (the answer was lost, or Redis cannot say): an unreferenced directory may be left
behind, never a referenced one removed (short of a concurrent publish of the very same bytes under
another logical ID in that instant, which it cannot see).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.adapters.objstore import ObjectArtifact, ObjectStore
from gateway.adapters.store import AdapterStore, Progress, StoredArtifact
from gateway.core.identity import ManifestEntry, check_logical_id, versioned_name
from gateway.core.model import Change
from gateway.table.epoch_table import EpochTable


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
) -> Published:
    """MANIFEST: ``store.scan(adapter_dir)`` when the caller has checked the directory already; PROGRESS:
    called with each chunk's bytes as the store copies them; BASE_PRINT: the fingerprint of BASE
    (``core.base_print``), '' when none could be taken."""
    check_logical_id(logical_id)
    if manifest is None:
        manifest = store.scan(adapter_dir)
    await table.ensure_generation()  # Redis answers and takes writes: checked before the store is written
    artifact = store.ingest(adapter_dir, manifest, progress)
    name = versioned_name(logical_id, artifact.digest)
    try:
        change = await table.publish(logical_id, artifact.digest, name, str(artifact.path), base, base_print)
    except Exception:
        if artifact.created and not await _may_be_recorded(table, logical_id, base, artifact.digest):
            _remove(store, artifact)
        raise
    return Published(logical_id, artifact.digest, name, artifact.path, change)


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
