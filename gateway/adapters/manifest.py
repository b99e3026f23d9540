"""An object-store version's manifest: every file's relative path, size and blake3, parsed at the boundary.

The directory store needs none (the directory is the manifest); an object store cannot list a tree
atomically, so each version has ``<prefix>/<digest>.json``, written after all its files and never
overwritten. Its entries determine the tree digest by themselves (``core.identity.tree_digest`` hashes
exactly (path, size, blake3 of contents) per file), so a reader checks a manifest against the digest it
asked for before fetching a byte, then checks each file's blake3 as it arrives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from blake3 import blake3

from gateway.core.errors import StoreUnavailable
from gateway.core.identity import MAX_FILES, TREE_DOMAIN, ManifestEntry

FORMAT = "kvgate-manifest-v1"
_HEX = re.compile(r"[0-9a-f]{64}")
_PART = re.compile(r"[A-Za-z0-9._-]+")


class BadManifest(StoreUnavailable):
    """A manifest that is not what kvgate writes, or does not hash to the digest it is stored under."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    relpath: str
    size: int
    blake3: str  # hex digest of the file's contents

    @property
    def entry(self) -> ManifestEntry:
        return ManifestEntry(self.relpath, self.size)


def digest_of(files: list[FileEntry]) -> str:
    """The tree digest these entries stand for: ``core.identity.tree_digest`` without the bytes."""
    tree = blake3(TREE_DOMAIN)
    for item in files:
        name = item.relpath.encode()
        tree.update(len(name).to_bytes(4, "big") + name + item.size.to_bytes(8, "big"))
        tree.update(bytes.fromhex(item.blake3))
    return tree.hexdigest()


def encode(digest: str, files: list[FileEntry]) -> bytes:
    doc = {
        "format": FORMAT,
        "digest": digest,
        "files": [{"path": f.relpath, "size": f.size, "blake3": f.blake3} for f in files],
    }
    return json.dumps(doc, sort_keys=True).encode()


def parse(raw: bytes, digest: str) -> list[FileEntry]:
    """The files of the manifest RAW, stored as DIGEST's; ``BadManifest`` unless it is well formed,
    names only safe relative paths, and its entries hash to DIGEST."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadManifest(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("digest") != digest:
        raise BadManifest(f"not a {FORMAT} manifest of this digest")
    items = doc.get("files")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_FILES:
        raise BadManifest(f"files must be a list of 1 to {MAX_FILES} entries")
    files = [_file(item) for item in items]
    paths = [f.relpath for f in files]
    if paths != sorted(set(paths)):
        raise BadManifest("file paths must be unique and sorted")
    if digest_of(files) != digest:
        raise BadManifest("its entries do not hash to the digest it is stored under")
    return files


def _file(item: object) -> FileEntry:
    if not isinstance(item, dict) or set(item) != {"path", "size", "blake3"}:
        raise BadManifest("each file is {path, size, blake3}")
    path, size, content = item["path"], item["size"], item["blake3"]
    if not isinstance(path, str) or not all(
        _PART.fullmatch(p) and p not in {".", ".."} for p in path.split("/")
    ):
        raise BadManifest(f"unsafe file path {path!r}")
    if type(size) is not int or size < 0:
        raise BadManifest(f"size of {path!r} is not a non-negative integer")
    if not isinstance(content, str) or not _HEX.fullmatch(content):
        raise BadManifest(f"blake3 of {path!r} is not 64 hex digits")
    return FileEntry(path, size, content)
