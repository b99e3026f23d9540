"""The content-addressed adapter store: ``<store>/<full blake3 digest>/``, written once, never changed.

Ingest copies into a private temporary directory inside the store, fsyncs every file, digests the
copy (so the digest names exactly the bytes stored), then renames it into place and fsyncs the store.
A crash or an error at any point leaves at most a ``.incoming-*`` directory that no version points to.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gateway.core.identity import ManifestEntry, check_digest, scan_adapter, tree_digest

INCOMING_PREFIX = ".incoming-"


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    digest: str
    path: Path
    created: bool  # False when the same bytes were already in the store


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path_for(self, digest: str) -> Path:
        return self.root / check_digest(digest)

    def contains(self, digest: str) -> bool:
        return self.path_for(digest).is_dir()

    def ingest(self, source: Path) -> StoredArtifact:
        manifest = scan_adapter(source)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=INCOMING_PREFIX, dir=self.root))
        try:
            _copy_manifest(source, staging, manifest)
            digest = tree_digest(staging, manifest)
            final = self.path_for(digest)
            if final.is_dir():
                return StoredArtifact(digest, final, created=False)
            _fsync_dir(staging)
            try:
                os.rename(staging, final)
            except OSError:
                if final.is_dir():  # a concurrent publish of the same bytes won the rename
                    return StoredArtifact(digest, final, created=False)
                raise
            _fsync_dir(self.root)
            return StoredArtifact(digest, final, created=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)


def _copy_manifest(source: Path, target: Path, manifest: list[ManifestEntry]) -> None:
    for entry in manifest:
        dst = target / entry.relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(source / entry.relpath, "rb") as fin, open(dst, "xb") as fout:
            shutil.copyfileobj(fin, fout, length=1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        os.chmod(dst, 0o444)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
