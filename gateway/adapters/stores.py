"""The one interface to the content store, a directory (``adapters.store``) or an object store
(``adapters.objstore``): publish, rollback's proof and the loader use nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from gateway.adapters.objstore import ObjectStore, is_object_url
from gateway.adapters.store import DEFAULT_MAX_BYTES, AdapterStore, Progress
from gateway.core.identity import ManifestEntry


class Artifact(Protocol):
    @property
    def digest(self) -> str: ...
    @property
    def path(self) -> Path | str: ...
    @property
    def created(self) -> bool: ...


class ContentStore(Protocol):
    max_bytes: int

    def scan(self, source: Path) -> list[ManifestEntry]: ...
    def ingest(
        self, source: Path, manifest: list[ManifestEntry] | None = None, progress: Progress | None = None
    ) -> Artifact: ...
    def proves(self, digest: str, path: str) -> bool: ...


def open_store(location: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> AdapterStore | ObjectStore:
    """The store at LOCATION: ``s3://BUCKET/PREFIX`` is an object store, anything else a directory."""
    if isinstance(location, str) and is_object_url(location):
        return ObjectStore(location, max_bytes=max_bytes)
    return AdapterStore(Path(location), max_bytes=max_bytes)


def location_prefix(store: AdapterStore | ObjectStore) -> str:
    """What every root of this store starts with (a directory's resolved path, or the URL), with '/'."""
    if isinstance(store, ObjectStore):
        return store.location_prefix
    return f"{store.root}/"
