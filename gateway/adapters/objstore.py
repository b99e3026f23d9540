"""The content-addressed adapter store on an object store (``--store s3://BUCKET/PREFIX``).

Laid out like the directory store: ``<prefix>/<digest>/<relpath>`` for each file, plus the manifest
``<prefix>/<digest>.json`` (``adapters.manifest``: paths, sizes, per-file blake3), written after every
file. A version is in the store exactly when its manifest is. Every write is conditional
(``If-None-Match: *``): nothing stored is ever overwritten; large files go up in multipart parts. An
adapter larger than ``max_bytes`` is refused from its scan, before a byte is sent, and each upload reads
no more than the scan counted and re-hashes what it sends: a file that changed meanwhile is refused (its
object, under a digest no manifest names, is deleted again).

Publishing the same bytes again writes nothing but ``<prefix>/.touched/<digest>`` (no adapter bytes:
the one object ever rewritten), which ``kvgate gc`` reads as the version's age, as it reads a
directory's mtime. The endpoint, region and credentials come from the usual ``AWS_*`` environment
(``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ALLOW_HTTP``...), read by the client library, ``obstore`` (docs/object-store.md says why), opened
with a deadline on every call (``adapters.objclient``). Every error is a ``StoreUnavailable`` naming the
call that failed; cleaning up after a failed upload never hides it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
from blake3 import blake3
from obstore.exceptions import AlreadyExistsError, BaseError

from gateway.adapters.manifest import BadManifest, FileEntry, digest_of, encode, parse
from gateway.adapters.objclient import REQUEST_S, Client, describe
from gateway.adapters.objclient import is_object_url as is_object_url  # where callers found them
from gateway.adapters.objclient import open_client as open_client
from gateway.adapters.store import DEFAULT_MAX_BYTES, Progress
from gateway.core.errors import InvalidAdapter, StoreUnavailable
from gateway.core.identity import ManifestEntry, check_digest, scan_adapter

log = logging.getLogger(__name__)
PART_BYTES = 8 << 20  # multipart above this, in parts of this size
_READ = 1 << 20
TOUCHED = ".touched/"
INCOMING = ".incoming/"  # large files on their way up, each under a random key, copied into place


@dataclass(frozen=True, slots=True)
class ObjectArtifact:
    digest: str
    path: str  # s3://BUCKET/PREFIX/<digest>: what the table records; a replica's agent fetches it
    created: bool  # False when the same bytes were already in the store
    files: tuple[FileEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class StoredVersion:
    digest: str
    path: str
    modified: float  # wall-clock seconds: the later of the manifest's write and its last touch
    bytes: int


class ObjectStore:
    def __init__(self, url: str, *, max_bytes: int = DEFAULT_MAX_BYTES, client: Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.max_bytes = max_bytes
        self.client = open_client(self.url) if client is None else client
        # A server-side copy sends nothing until it is done (moto copies about as fast as it receives, so
        # 2 GiB takes a minute): only its REQUEST_S deadline applies. Every call before it stalls out fast.
        self._copier = open_client(self.url, stall_s=REQUEST_S) if client is None else client

    @property
    def location_prefix(self) -> str:
        return f"{self.url}/"

    def path_for(self, digest: str) -> str:
        return f"{self.url}/{check_digest(digest)}"

    def manifest_key(self, digest: str) -> str:
        return f"{check_digest(digest)}.json"

    def contains(self, digest: str) -> bool:
        return self._head(self.manifest_key(digest)) is not None

    def proves(self, digest: str, path: str) -> bool:
        try:
            return path == self.path_for(digest) and self.contains(digest)
        except (InvalidAdapter, StoreUnavailable):
            return False

    def scan(self, source: Path) -> list[ManifestEntry]:
        manifest = scan_adapter(source)
        total = sum(entry.size for entry in manifest)
        if total > self.max_bytes:
            raise InvalidAdapter(
                f"{str(source)!r} holds {total} bytes, over max_adapter_bytes ({self.max_bytes})"
            )
        return manifest

    def ingest(
        self, source: Path, manifest: list[ManifestEntry] | None = None, progress: Progress | None = None
    ) -> ObjectArtifact:
        if manifest is None:
            manifest = self.scan(source)
        files = [FileEntry(e.relpath, e.size, _hash_file(source / e.relpath, e.size)) for e in manifest]
        digest = digest_of(files)
        if self.contains(digest):
            self._touch(digest)  # published again: young for `kvgate gc`
            return ObjectArtifact(digest, self.path_for(digest), created=False, files=tuple(files))
        for item in files:
            self._upload(source, digest, item, progress)
        try:
            self._put(self.manifest_key(digest), encode(digest, files))
        except AlreadyExistsError:  # a concurrent publish of the same bytes wrote it first
            return ObjectArtifact(digest, self.path_for(digest), created=False, files=tuple(files))
        return ObjectArtifact(digest, self.path_for(digest), created=True, files=tuple(files))

    def remove(self, artifact: ObjectArtifact) -> None:
        """Take back a version this process's ``ingest`` created and nothing points at."""
        if not artifact.created:
            raise ValueError(f"{artifact.path} was not created by this ingest: it is not ours to remove")
        self.delete_version(artifact.digest)

    def read_manifest(self, digest: str) -> list[FileEntry]:
        raw = self._get(self.manifest_key(digest))
        try:
            return parse(raw, digest)
        except BadManifest as exc:
            raise StoreUnavailable(
                f"the manifest of {digest[:16]} in the object store is bad: {exc}"
            ) from None

    def versions(self) -> list[StoredVersion]:
        """Every version in the store (its manifest), with its age and size, for ``kvgate gc``."""
        found: dict[str, float] = {}
        touched: dict[str, float] = {}
        sizes: dict[str, int] = {}
        try:
            for batch in obstore.list(self.client, chunk_size=1000):
                for meta in batch:
                    key = str(meta["path"])
                    when = meta["last_modified"].timestamp()
                    if key.startswith(TOUCHED):
                        touched[key.removeprefix(TOUCHED)] = when
                    elif key.endswith(".json") and _is_digest(key[:-5]):
                        found[key[:-5]] = when
                    elif (head := key.partition("/")[0]) != key:
                        sizes[head] = sizes.get(head, 0) + int(meta["size"])
        except BaseError as exc:
            raise StoreUnavailable(f"cannot list the object store {self.url}: {describe(exc)}") from None
        return [
            StoredVersion(d, self.path_for(d), max(when, touched.get(d, 0.0)), sizes.get(d, 0))
            for d, when in sorted(found.items())
        ]

    def modified(self, digest: str) -> float:
        """The version's age reference now (manifest write or touch); 0.0 when it has neither."""
        stamps = [
            meta["last_modified"].timestamp()
            for key in (self.manifest_key(digest), TOUCHED + digest)
            if (meta := self._head(key)) is not None
        ]
        return max(stamps, default=0.0)

    def delete_manifest(self, digest: str) -> None:
        """From now on the version is not in the store (its files stay until ``delete_version``)."""
        self._delete(self.manifest_key(digest))

    def delete_version(self, digest: str) -> None:
        """The manifest first (from then on the version is not in the store), then its files."""
        self._delete(self.manifest_key(digest))
        try:
            keys = [str(m["path"]) for batch in obstore.list(self.client, prefix=f"{digest}/") for m in batch]
        except BaseError as exc:
            raise StoreUnavailable(f"cannot list {digest[:16]}'s objects: {describe(exc)}") from None
        for key in [*keys, TOUCHED + digest]:
            self._delete(key)

    def restore_manifest(self, digest: str, raw: bytes) -> None:
        with contextlib.suppress(AlreadyExistsError):  # a publish wrote it again meanwhile: the same bytes
            self._put(self.manifest_key(digest), raw)

    def manifest_bytes(self, digest: str) -> bytes:
        return self._get(self.manifest_key(digest))

    # --- the calls, each error a StoreUnavailable naming what failed --------------------------------

    def _upload(self, source: Path, digest: str, item: FileEntry, progress: Progress | None) -> None:
        """A small file is one conditional PUT. A large one goes up in parts to a key of its own under
        ``.incoming/``, and is then copied to its place conditionally (a multipart copy whose completion
        carries ``If-None-Match: *``): the client library sends no condition on a multipart upload."""
        key = f"{digest}/{item.relpath}"
        check = blake3(max_threads=blake3.AUTO)
        chunks = _chunks(source / item.relpath, item.size, check, progress)
        staged = f"{INCOMING}{secrets.token_hex(8)}" if item.size > PART_BYTES else None
        try:
            if staged is None:
                self._put(key, chunks)
            else:
                self._call(
                    f"uploading {item.relpath!r} to {self.url}/{staged}",
                    obstore.put, self.client, staged, chunks,
                    use_multipart=True, chunk_size=PART_BYTES, max_concurrency=4,
                )  # fmt: skip
            if check.hexdigest() != item.blake3:
                if staged is None:
                    self._delete(key)
                raise InvalidAdapter(f"{item.relpath!r} changed while it was being uploaded")
            if staged is not None:
                self._call(
                    f"copying {item.relpath!r} into place at {self.url}/{key}",
                    obstore.copy, self._copier, staged, key, overwrite=False,
                )  # fmt: skip
        except AlreadyExistsError:  # left by an earlier publish that stopped: it must hold these bytes
            if self._hash_object(key) != item.blake3:
                raise StoreUnavailable(
                    f"{self.url}/{key} exists with other bytes (never overwritten): remove it, publish again"
                ) from None
        finally:
            if staged is not None:
                self._drop(staged)

    def _drop(self, staged: str) -> None:
        """Delete a staged upload, best effort: the caller hears how its upload ended, not how this did
        (a staged copy left behind is ``kvgate gc``'s, ``adapters.gc_leftovers``)."""
        try:
            self._delete(staged)
        except StoreUnavailable as exc:
            log.warning("%s; kvgate gc removes it once it is older than its retention", exc)

    def _call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except AlreadyExistsError:
            raise
        except BaseError as exc:
            raise StoreUnavailable(f"{what} failed: {describe(exc)}") from None

    def _put(self, key: str, data: bytes | Iterator[bytes], *, parts: bool = False) -> None:
        """Write KEY only if it does not exist (``If-None-Match: *``, on the multipart completion too)."""
        try:
            obstore.put(
                self.client,
                key,
                data,
                mode="create",
                use_multipart=parts,
                chunk_size=PART_BYTES,
                max_concurrency=4,
            )
        except AlreadyExistsError:
            raise
        except BaseError as exc:
            raise StoreUnavailable(f"writing {self.url}/{key} failed: {describe(exc)}") from None

    def _touch(self, digest: str) -> None:
        try:
            obstore.put(self.client, TOUCHED + digest, str(time.time()).encode())
        except BaseError as exc:
            raise StoreUnavailable(f"touching {digest[:16]} failed: {describe(exc)}") from None

    def _get(self, key: str) -> bytes:
        try:
            return bytes(obstore.get(self.client, key).bytes())
        except FileNotFoundError:
            raise StoreUnavailable(f"{self.url}/{key} is missing from the object store") from None
        except BaseError as exc:
            raise StoreUnavailable(f"reading {self.url}/{key} failed: {describe(exc)}") from None

    def _head(self, key: str) -> Any:
        try:
            return obstore.head(self.client, key)
        except FileNotFoundError:
            return None
        except BaseError as exc:
            raise StoreUnavailable(f"reading {self.url}/{key} failed: {describe(exc)}") from None

    def _delete(self, key: str) -> None:
        try:
            obstore.delete(self.client, key)
        except FileNotFoundError:
            pass
        except BaseError as exc:
            raise StoreUnavailable(f"deleting {self.url}/{key} failed: {describe(exc)}") from None

    def _hash_object(self, key: str) -> str:
        content = blake3(max_threads=blake3.AUTO)
        try:
            for chunk in obstore.get(self.client, key):
                content.update(chunk)
        except BaseError as exc:
            raise StoreUnavailable(f"reading {self.url}/{key} failed: {describe(exc)}") from None
        return content.hexdigest()


def _hash_file(path: Path, size: int) -> str:
    content = blake3(max_threads=blake3.AUTO)
    try:
        if size:
            content.update_mmap(str(path))
        if os.stat(path, follow_symlinks=False).st_size != size:
            raise InvalidAdapter(f"{path.name!r} changed while it was being read")
    except OSError as exc:
        raise InvalidAdapter(f"cannot read {path.name!r}: {exc.strerror}") from exc
    return content.hexdigest()


def _chunks(path: Path, size: int, check: blake3, progress: Progress | None) -> Iterator[bytes]:
    """The file's bytes, no more than SIZE of them, hashed into CHECK as they are sent."""
    with open(path, "rb") as fin:
        left = size
        while left and (chunk := fin.read(min(_READ, left))):
            check.update(chunk)
            left -= len(chunk)
            if progress is not None:
                progress(len(chunk))
            yield chunk
        if left or fin.read(1):
            check.update(b"\0changed")  # the digest check after the upload refuses it
    if size == 0:
        yield b""


def _is_digest(text: str) -> bool:
    try:
        check_digest(text)
    except InvalidAdapter:
        return False
    return True
