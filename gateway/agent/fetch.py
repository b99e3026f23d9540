"""The agent's one job: make ``<local>/<digest>/`` hold exactly DIGEST's bytes, fetched from the object store.

A fetch reads the manifest, checks that its entries hash to DIGEST (``adapters.manifest.parse``), makes
room under the disk budget, streams every file into a private ``.incoming-*`` directory, hashing each as it
arrives and never writing more than its manifest size, fsyncs, recomputes the tree digest from the bytes
on disk, and only then renames the directory to ``<local>/<digest>/`` (atomic; 0755 directories, 0444
files). Any failure removes the incoming directory: nothing unverified is ever at a digest's path. An
agent that stopped mid-fetch removes what it left at its next start. Concurrent asks for one digest share
one fetch.

The disk budget evicts the least recently asked digests first, never one the replica lists as loaded
(its ``/v1/models``, read when room is needed: when it cannot be read, nothing is evicted) and never one
answered within ``hold_s`` (kvgate asked for it to load it right after).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO

import obstore
from blake3 import blake3
from obstore.exceptions import BaseError

from gateway.adapters.manifest import BadManifest, FileEntry, parse
from gateway.adapters.objstore import Client
from gateway.adapters.store import DIR_MODE, FILE_MODE, INCOMING_PREFIX
from gateway.core.errors import InvalidAdapter, StoreUnavailable
from gateway.core.identity import check_digest, tree_digest

log = logging.getLogger(__name__)
EVICTING_PREFIX = ".evicting-"
OUTCOMES = (
    "fetched",
    "cached",
    "changed",
    "truncated",
    "missing",
    "unreachable",
    "disk-full",
    "budget",
    "bad-manifest",
)
Loaded = Callable[[], Awaitable[set[str]]]
"""The digests the replica lists as loaded (the last component of each adapter's root)."""


class FetchFailed(StoreUnavailable):
    """OUTCOME (one of ``OUTCOMES``): what went wrong; DETAIL: the agent's own words (its log, its answer)."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(f"{outcome}: {detail}", code=outcome)
        self.outcome = outcome
        self.detail = detail


class Fetcher:
    def __init__(
        self, client: Client, root: Path, *, budget_bytes: int, loaded: Loaded, hold_s: float = 300.0
    ) -> None:
        self.client = client
        self.root = root.resolve()
        self.budget_bytes = budget_bytes
        self.loaded = loaded
        self.hold_s = hold_s
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.last_asked: dict[str, float] = {}  # digest -> monotonic time of its last ask
        self._fetching: dict[str, asyncio.Task[Path]] = {}
        self._room = asyncio.Lock()
        self._pending: dict[str, int] = {}  # digest -> bytes of a fetch under way (counted as used)

    def start(self) -> list[str]:
        """Remove what a stopped agent left (incoming and evicting directories); the names removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        left = [p for p in self.root.iterdir() if p.name.startswith((INCOMING_PREFIX, EVICTING_PREFIX))]
        for path in left:
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s, left by an agent that stopped mid-fetch", path.name)
        return [p.name for p in left]

    def local(self) -> dict[str, int]:
        """Digest -> bytes, for every verified digest directory here."""
        found = {}
        for path in self.root.iterdir():
            if path.is_dir() and len(path.name) == 64 and not path.name.startswith("."):
                found[path.name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return found

    async def ensure(self, digest: str) -> Path:
        """``<local>/<digest>/``, fetched and verified if it is not here yet; ``FetchFailed`` otherwise."""
        check_digest(digest)
        self.last_asked[digest] = time.monotonic()
        final = self.root / digest
        if final.is_dir():
            self.counts["cached"] += 1
            return final
        task = self._fetching.get(digest)
        if task is None:
            task = asyncio.create_task(self._fetch(digest))
            self._fetching[digest] = task
            task.add_done_callback(lambda _: self._fetching.pop(digest, None))
        path = await asyncio.shield(task)
        self.last_asked[digest] = time.monotonic()
        return path

    async def _fetch(self, digest: str) -> Path:
        try:
            path = await self._fetch_verified(digest)
        except FetchFailed as exc:
            self.counts[exc.outcome] += 1
            log.warning("fetch of %s failed: %s", digest, exc)
            raise
        self.counts["fetched"] += 1
        return path

    async def _fetch_verified(self, digest: str) -> Path:
        files = await self._manifest(digest)
        need = sum(item.size for item in files)
        async with self._room:
            await self._make_room(need, digest)
            staging = Path(tempfile.mkdtemp(prefix=INCOMING_PREFIX, dir=self.root))
            self._pending[digest] = need
        try:
            for item in files:
                await self._download(digest, item, staging)
            try:
                on_disk = tree_digest(staging, [item.entry for item in files])
            except InvalidAdapter as exc:
                raise FetchFailed("changed", str(exc)) from None
            if on_disk != digest:
                raise FetchFailed("changed", f"the fetched tree hashes to {on_disk[:16]}, not {digest[:16]}")
            _publish(staging, self.root / digest)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise FetchFailed("disk-full", f"the local volume is full: {exc.strerror}") from None
            raise FetchFailed("disk-full", f"writing the local copy failed: {exc}") from None
        finally:
            self._pending.pop(digest, None)
            shutil.rmtree(staging, ignore_errors=True)
        return self.root / digest

    async def _manifest(self, digest: str) -> list[FileEntry]:
        raw = await self._read(f"{digest}.json", "the manifest")
        try:
            return parse(raw, digest)
        except BadManifest as exc:
            raise FetchFailed("bad-manifest", str(exc)) from None

    async def _read(self, key: str, what: str) -> bytes:
        try:
            return bytes(await (await obstore.get_async(self.client, key)).bytes_async())
        except FileNotFoundError:
            raise FetchFailed("missing", f"{what} is missing from the object store") from None
        except BaseError as exc:
            raise FetchFailed("unreachable", f"reading {what} failed: {_line(exc)}") from None

    async def _download(self, digest: str, item: FileEntry, staging: Path) -> None:
        target = staging / item.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        content = blake3(max_threads=blake3.AUTO)
        written = 0
        try:
            answer = await obstore.get_async(self.client, f"{digest}/{item.relpath}")
            out = _create(target)
            try:
                async for chunk in answer.stream(min_chunk_size=1 << 20):
                    written += len(chunk)
                    if written > item.size:
                        raise FetchFailed("changed", f"{item.relpath!r} is longer than its manifest says")
                    content.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            finally:
                out.close()
        except FileNotFoundError:
            raise FetchFailed("missing", f"{item.relpath!r} is missing from the object store") from None
        except BaseError as exc:
            raise FetchFailed("unreachable", f"reading {item.relpath!r} failed: {_line(exc)}") from None
        if written < item.size:
            raise FetchFailed("truncated", f"{item.relpath!r} has {written} of its {item.size} bytes")
        if content.hexdigest() != item.blake3:
            raise FetchFailed("changed", f"{item.relpath!r} does not hash to its manifest's blake3")
        os.chmod(target, FILE_MODE)

    async def _make_room(self, need: int, digest: str) -> None:
        if need > self.budget_bytes:
            raise FetchFailed("budget", f"{need} bytes exceed the agent's disk budget ({self.budget_bytes})")
        here = self.local()
        used = sum(here.values()) + sum(self._pending.values())
        if used + need <= self.budget_bytes:
            return
        try:
            loaded = await self.loaded()
        except Exception as exc:  # cannot tell what the replica has loaded: evict nothing
            raise FetchFailed(
                "budget", f"no room, and the replica's adapters cannot be read: {exc}"
            ) from None
        now = time.monotonic()
        candidates = sorted(
            (
                d
                for d in here
                if d not in loaded and d != digest and now - self.last_asked.get(d, 0.0) > self.hold_s
            ),
            key=lambda d: self.last_asked.get(d, 0.0),
        )
        for victim in candidates:
            if used + need <= self.budget_bytes:
                break
            trash = self.root / f"{EVICTING_PREFIX}{victim}"
            os.rename(self.root / victim, trash)  # gone from its path at once, then deleted
            shutil.rmtree(trash, ignore_errors=True)
            used -= here[victim]
            self.last_asked.pop(victim, None)
            log.info("evicted %s (%d bytes) for %s", victim, here[victim], digest)
        if used + need > self.budget_bytes:
            raise FetchFailed("budget", f"no room for {need} bytes: the rest is loaded or was just asked for")


def _create(path: Path) -> BinaryIO:
    return open(path, "xb")


def _publish(staging: Path, final: Path) -> None:
    """Make the verified STAGING readable by the replica's user and rename it to FINAL, durably."""
    for directory in {staging, *(p.parent for p in staging.rglob("*"))}:
        os.chmod(directory, DIR_MODE)
    _fsync(staging)
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():  # another agent on this volume renamed the same verified bytes first
            raise
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
