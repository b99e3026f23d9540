"""The content-addressed adapter store: ``<store>/<full blake3 digest>/``, written once, never changed.

Ingest copies into a private temporary directory inside the store, fsyncs every file, digests the
copy (so the digest names exactly the bytes stored), then renames it into place and fsyncs the store.
A crash or an error at any point leaves at most a ``.incoming-*`` directory that no version points to.
An adapter larger than ``max_bytes`` is refused from its manifest, before a byte is copied, and the copy
reads no more than the manifest counted. Stored directories are 0755 and files 0444: readable by a
replica running as another user, writable by nobody.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.core.atomic_file import fsync_directory
from gateway.core.errors import InvalidAdapter
from gateway.core.identity import (
    ADAPTER_CONFIG,
    ManifestEntry,
    check_adapter_config,
    check_digest,
    scan_adapter,
    tree_digest,
)

INCOMING_PREFIX = ".incoming-"
DEFAULT_MAX_BYTES = 2 << 30
DIR_MODE, FILE_MODE = 0o755, 0o444
_CHUNK = 1 << 20
Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    digest: str
    path: Path
    created: bool  # False when the same bytes were already in the store


class AdapterStore:
    def __init__(self, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root.resolve()
        self.max_bytes = max_bytes

    def path_for(self, digest: str) -> Path:
        return self.root / check_digest(digest)

    def contains(self, digest: str) -> bool:
        return self.path_for(digest).is_dir()

    def proves(self, digest: str, path: str) -> bool:
        """Whether PATH is this store's directory for DIGEST and holds it (so it holds DIGEST's bytes)."""
        try:
            return Path(path) == self.path_for(digest) and self.contains(digest)
        except InvalidAdapter:
            return False

    def scan(self, source: Path) -> list[ManifestEntry]:
        """Validate SOURCE (``scan_adapter``) and refuse it if it is larger than ``max_bytes``."""
        manifest = scan_adapter(source)
        total = sum(entry.size for entry in manifest)
        if total > self.max_bytes:
            raise InvalidAdapter(
                f"{str(source)!r} holds {total} bytes, over max_adapter_bytes ({self.max_bytes})"
            )
        return manifest

    def ingest(
        self, source: Path, manifest: list[ManifestEntry] | None = None, progress: Progress | None = None
    ) -> StoredArtifact:
        """Store SOURCE (MANIFEST: its ``scan``, when the caller has made it already); PROGRESS is called
        with the number of bytes of each chunk copied (a progress bar's advance)."""
        if manifest is None:
            manifest = self.scan(source)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=INCOMING_PREFIX, dir=self.root))
        try:
            _copy_manifest(source, staging, manifest, progress)
            check_adapter_config((staging / ADAPTER_CONFIG).read_bytes())  # the copy is what was checked
            digest = tree_digest(staging, manifest)
            final = self.path_for(digest)
            if _touched(final):  # published again: young for `kvgate gc` (gateway/adapters/gc.py)
                return StoredArtifact(digest, final, created=False)
            fsync_directory(staging)
            try:
                os.rename(staging, final)
            except OSError:
                if _touched(final):  # a concurrent publish of the same bytes won the rename
                    return StoredArtifact(digest, final, created=False)
                raise
            fsync_directory(self.root)
            return StoredArtifact(digest, final, created=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def remove(self, artifact: StoredArtifact) -> None:
        """Take back a directory this process's ``ingest`` created and nothing points at."""
        if not artifact.created:
            raise ValueError(f"{artifact.path} was not created by this ingest: it is not ours to remove")
        shutil.rmtree(artifact.path)
        fsync_directory(self.root)


def _copy_manifest(
    source: Path, target: Path, manifest: list[ManifestEntry], progress: Progress | None
) -> None:
    for entry in manifest:
        dst = target / entry.relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(source / entry.relpath, "rb") as fin, open(dst, "xb") as fout:
            left = entry.size
            while left and (chunk := fin.read(min(_CHUNK, left))):
                fout.write(chunk)
                left -= len(chunk)
                if progress is not None:
                    progress(len(chunk))
            if left or fin.read(1):  # shorter or longer than scanned: never copy more than was counted
                raise InvalidAdapter(f"{entry.relpath!r} changed while it was being copied")
            fout.flush()
            os.fsync(fout.fileno())
        os.chmod(dst, FILE_MODE)
    for directory in {target, *(path.parent for path in target.rglob("*"))}:
        os.chmod(directory, DIR_MODE)  # mkdtemp makes 0700, and the umask may narrow the others


def _touched(path: Path) -> bool:
    """Whether PATH is a directory; if so its mtime is set to now (a directory gc keeps, as young)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    except PermissionError:  # another user's directory: it stays as old as it was
        pass
    return path.is_dir()
