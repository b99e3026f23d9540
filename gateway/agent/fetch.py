"""The agent's one job: make ``<local>/<digest>/`` hold exactly DIGEST's bytes, fetched from the object store.

A fetch reads the manifest, checks that its entries hash to DIGEST (``adapters.manifest.parse``), makes
room under the disk budget, streams every file into a private ``.incoming-*`` directory, hashing each as it
arrives and never writing more than its manifest size (one pass: the bytes written are the bytes hashed,
so each file's size and blake3 checked against the manifest make the tree DIGEST's without reading it
again), fsyncs, and only then renames the directory to ``<local>/<digest>/`` (atomic; 0755 directories,
0444 files) and writes its stamp, ``<local>/.stamps/<digest>.json``: every entry's size, times and inode.
Any failure removes the incoming directory: nothing unverified is ever at a digest's path. An agent that
stopped mid-fetch removes what it left at its next start. Concurrent asks for one digest share one fetch.
Hashing and every disk write and fsync run in worker threads: the event loop (``/healthz``, other asks)
never waits for the disk.

A copy already here is handed out only while it matches its stamp (a few ``lstat`` calls, no hashing):
any write, chmod, added or removed file changes a ctime, which nothing can set back. A copy that does
not match, or has no stamp, is removed and fetched again (counted ``altered``).

The disk budget evicts the least recently asked digests first, never one the replica lists as loaded
(its ``/v1/models``, read when room is needed: when it cannot be read, nothing is evicted) and never one
answered within ``hold_s`` (kvgate asked for it to load it right after).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
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
from gateway.adapters.objclient import Client, describe
from gateway.adapters.store import DIR_MODE, FILE_MODE, INCOMING_PREFIX
from gateway.core.atomic_file import fsync_directory, write_atomically
from gateway.core.errors import StoreUnavailable
from gateway.core.identity import check_digest

log = logging.getLogger(__name__)
EVICTING_PREFIX = ".evicting-"
STAMPS = ".stamps"
OUTCOMES = (
    "fetched",
    "cached",
    "altered",
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
        task = self._fetching.get(digest)
        if task is None and await asyncio.to_thread(self._intact, digest):
            self.counts["cached"] += 1
            return self.root / digest
        task = self._fetching.get(digest)  # another ask may have started it meanwhile
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
        final = self.root / digest
        if await asyncio.to_thread(self._intact, digest):  # a fetch that ended while this ask looked
            return final
        if final.exists():
            log.warning("the local copy of %s is not as its stamp says (altered): fetching it again", digest)
            self.counts["altered"] += 1
            await asyncio.to_thread(self._remove, digest)
        files = await self._manifest(digest)
        need = sum(item.size for item in files)
        async with self._room:
            await self._make_room(need, digest)
            staging = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=INCOMING_PREFIX, dir=self.root))
            self._pending[digest] = need
        try:
            for item in files:  # each one's size and blake3 checked: together they hash to DIGEST (parse)
                await self._download(digest, item, staging)
            await asyncio.to_thread(_publish, staging, final, self._stamp(digest))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise FetchFailed("disk-full", f"the local volume is full: {exc.strerror}") from None
            raise FetchFailed("disk-full", f"writing the local copy failed: {exc}") from None
        finally:
            self._pending.pop(digest, None)
            await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
        return final

    def _stamp(self, digest: str) -> Path:
        return self.root / STAMPS / f"{digest}.json"

    def _intact(self, digest: str) -> bool:
        """Whether ``<local>/<digest>/`` is here and exactly as this agent stamped it (run in a thread)."""
        try:
            stamp = json.loads(self._stamp(digest).read_bytes())
            return bool(stamp == _entries(self.root / digest))
        except (OSError, ValueError):
            return False

    def _remove(self, digest: str) -> None:
        """Take ``<local>/<digest>/`` and its stamp away: gone from its path at once, then deleted."""
        self._stamp(digest).unlink(missing_ok=True)
        trash = Path(tempfile.mkdtemp(prefix=f"{EVICTING_PREFIX}{digest[:16]}-", dir=self.root))
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.root / digest, trash / digest)
        shutil.rmtree(trash, ignore_errors=True)

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
            raise FetchFailed("unreachable", f"reading {what} failed: {describe(exc)}") from None

    async def _download(self, digest: str, item: FileEntry, staging: Path) -> None:
        """Stream ITEM into STAGING: each chunk hashed and written in a worker thread, then fsynced there."""
        try:
            answer = await obstore.get_async(self.client, f"{digest}/{item.relpath}")
            sink = await asyncio.to_thread(_Sink, staging / item.relpath)
            try:
                async for chunk in answer.stream(min_chunk_size=1 << 20):
                    if sink.written + len(chunk) > item.size:
                        raise FetchFailed("changed", f"{item.relpath!r} is longer than its manifest says")
                    await asyncio.to_thread(sink.write, chunk)
                await asyncio.to_thread(sink.flush)
            finally:
                await asyncio.to_thread(sink.out.close)
        except FileNotFoundError:
            raise FetchFailed("missing", f"{item.relpath!r} is missing from the object store") from None
        except BaseError as exc:
            raise FetchFailed("unreachable", f"reading {item.relpath!r} failed: {describe(exc)}") from None
        if sink.written < item.size:
            raise FetchFailed("truncated", f"{item.relpath!r} has {sink.written} of its {item.size} bytes")
        if sink.content.hexdigest() != item.blake3:
            raise FetchFailed("changed", f"{item.relpath!r} does not hash to its manifest's blake3")

    async def _make_room(self, need: int, digest: str) -> None:
        if need > self.budget_bytes:
            raise FetchFailed("budget", f"{need} bytes exceed the agent's disk budget ({self.budget_bytes})")
        here = await asyncio.to_thread(self.local)
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
            await asyncio.to_thread(self._remove, victim)
            used -= here[victim]
            self.last_asked.pop(victim, None)
            log.info("evicted %s (%d bytes) for %s", victim, here[victim], digest)
        if used + need > self.budget_bytes:
            raise FetchFailed("budget", f"no room for {need} bytes: the rest is loaded or was just asked for")


class _Sink:
    """One file on its way in (its methods run in worker threads): every chunk is hashed and written in
    the same pass, so the digest is of exactly the bytes on disk."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.out: BinaryIO = open(path, "xb")  # noqa: SIM115 (closed by the fetch, in a thread)
        self.content = blake3(max_threads=blake3.AUTO)
        self.written = 0

    def write(self, chunk: bytes) -> None:
        self.content.update(chunk)
        self.out.write(chunk)
        self.written += len(chunk)

    def flush(self) -> None:
        self.out.flush()
        os.fsync(self.out.fileno())
        os.chmod(self.out.name, FILE_MODE)


def _publish(staging: Path, final: Path, stamp: Path) -> None:
    """Make the verified STAGING readable by the replica's user, rename it to FINAL durably, and write
    FINAL's STAMP (its entries as they are now, after every chmod and the rename)."""
    for directory in {staging, *(p.parent for p in staging.rglob("*"))}:
        os.chmod(directory, DIR_MODE)
    fsync_directory(staging)
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():  # another agent on this volume renamed the same verified bytes first
            raise
    fsync_directory(final.parent)
    stamp.parent.mkdir(exist_ok=True)
    write_atomically(stamp, json.dumps(_entries(final), sort_keys=True).encode())


def _entries(root: Path) -> dict[str, list[int]]:
    """Every entry under ROOT (ROOT itself as ".", nothing followed): mode, size, mtime, ctime, inode."""
    found = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        name = path.relative_to(root).as_posix()
        found[name] = [st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    return found
