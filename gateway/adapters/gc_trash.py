"""How ``kvgate gc`` takes a version out of a store, and puts it back (``adapters.gc`` says when).

A directory store renames the directory away (atomic) and deletes it last. An object store deletes the
manifest first (from then on the version is not in the store: a publish of the same bytes writes the
manifest again), keeps its bytes to put it back, and deletes the files last. Either way a publish that
finds the version before it is taken touches it (young), and one after writes it afresh.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.adapters.objstore import ObjectStore
from gateway.adapters.store import AdapterStore
from gateway.core.errors import StoreUnavailable

TRASH_PREFIX = ".gc-"


@dataclass(frozen=True, slots=True)
class Listed:
    digest: str
    path: Path | str
    modified: float  # wall-clock seconds
    bytes: int


def listed(store: AdapterStore | ObjectStore, is_digest: object) -> list[Listed]:
    if isinstance(store, ObjectStore):
        return [Listed(v.digest, v.path, v.modified, v.bytes) for v in store.versions()]
    found = []
    for path in sorted(store.root.iterdir()) if store.root.is_dir() else []:
        if not (callable(is_digest) and is_digest(path.name) and path.is_dir()):
            continue  # .incoming-* (a publish under way), .gc-* (another gc), anything else
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        found.append(Listed(path.name, path, path.stat().st_mtime, size))
    return found


@dataclass(slots=True)
class Trash:
    store: AdapterStore | ObjectStore
    taken: dict[str, tuple[Path | str, Path | bytes]] = field(default_factory=dict)
    """digest -> (its path, where it went: the renamed directory, or the manifest's bytes)."""

    def take(self, digest: str, path: Path | str) -> None:
        if isinstance(self.store, ObjectStore):
            try:
                raw = self.store.manifest_bytes(digest)
            except StoreUnavailable:
                return  # another gc took it (or the store cannot say: leave it)
            self.store.delete_manifest(digest)
            self.taken[digest] = (path, raw)
            return
        trash = self.store.root / f"{TRASH_PREFIX}{digest}-{secrets.token_hex(4)}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return  # another gc took it
        self.taken[digest] = (path, trash)

    def age(self, digest: str, now: float | None = None) -> float:
        now = time.time() if now is None else now
        if isinstance(self.store, ObjectStore):
            return now - self.store.modified(digest)
        where = self.taken[digest][1]
        assert isinstance(where, Path)
        return now - where.stat().st_mtime

    def fresh_copy(self, digest: str) -> bool:
        """Whether a publish wrote the version afresh since it was taken (that copy stays)."""
        if isinstance(self.store, ObjectStore):
            return self.store.contains(digest)
        path = self.taken[digest][0]
        return isinstance(path, Path) and path.is_dir()

    def put_back(self, digest: str) -> None:
        path, where = self.taken[digest]
        if isinstance(where, bytes):
            assert isinstance(self.store, ObjectStore)
            self.store.restore_manifest(digest, where)
            return
        try:
            os.rename(where, path)
        except OSError:
            if not Path(path).is_dir():
                raise
            shutil.rmtree(where)  # a publish wrote the same bytes afresh meanwhile: that copy stays

    def delete(self, digest: str) -> bool:
        """Delete what was taken; False when an object store's version was published afresh meanwhile
        (its files are that copy's: they stay)."""
        where = self.taken[digest][1]
        if isinstance(where, bytes):
            assert isinstance(self.store, ObjectStore)
            if self.store.contains(digest):
                return False
            self.store.delete_version(digest)
        else:
            shutil.rmtree(where)
        return True
