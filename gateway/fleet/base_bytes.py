"""A base model's fingerprint from its bytes, where kvgate can read the model's directory.

The digest covers ``config.json``, the tokenizer files and the weight files (``BASE_FILES``), each
streamed through blake3 in 1 MiB reads, combined like an adapter's tree digest (sorted relative paths,
sizes, file digests). Hashing gigabytes takes a while, so each file's digest is cached by (path, size,
mtime in ns) in a JSON file in kvgate's data dir (``base-digests.json``): a kvgate restart, or a replica
restart over unchanged files, costs one ``stat`` per file, and a checkpoint copied over the directory
(new mtimes) is hashed again. The data dir, not memory: the point of the cache is to survive restarts;
a lost or corrupt cache file only costs one re-hash. Hashing runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from blake3 import blake3

from gateway.core.atomic_file import write_atomically

log = logging.getLogger(__name__)

BASE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
CHUNK = 1 << 20
CACHE_FILE = "base-digests.json"


def base_files(root: Path) -> list[Path]:
    """The files that make the base: config, tokenizer and weights (top level, sorted); [] if none."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.is_file() and (p.name in BASE_FILES or p.name.endswith(WEIGHT_SUFFIXES))]


class BaseBytes:
    """Digests of base model directories, per file cached by (path, size, mtime) in ``cache_path``."""

    def __init__(self, cache_path: Path | None) -> None:
        self.cache_path = cache_path
        self._cache: dict[str, list[int | str]] = self._read_cache()
        self.hashed_bytes = 0  # bytes read since start (a cached file costs none)
        self._dirty = False
        self._lock = asyncio.Lock()  # one hashing thread at a time: they share the cache

    def _read_cache(self) -> dict[str, list[int | str]]:
        if self.cache_path is None:
            return {}
        try:
            doc = json.loads(self.cache_path.read_text())
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_cache(self) -> None:
        if self.cache_path is None or not self._dirty:
            return
        self._dirty = False
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            doc = json.dumps(self._cache, sort_keys=True).encode()
            write_atomically(self.cache_path, doc)  # workers share it: each its own temporary file
        except OSError as exc:
            log.warning("could not write the base digest cache %s: %s", self.cache_path, exc)

    def _file_digest(self, path: Path) -> tuple[int, str]:
        stat = path.stat()
        key = str(path.resolve())
        cached = self._cache.get(key)
        if cached is not None and cached[0] == stat.st_size and cached[1] == stat.st_mtime_ns:
            return stat.st_size, str(cached[2])
        hasher = blake3()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                hasher.update(chunk)
                self.hashed_bytes += len(chunk)
        digest = hasher.hexdigest()
        self._cache[key] = [stat.st_size, stat.st_mtime_ns, digest]
        self._dirty = True
        return stat.st_size, digest

    def digest(self, root: Path) -> str | None:
        """The directory's base digest (64 hex), or None when it holds no base files or cannot be read."""
        files = base_files(root)
        if not files:
            return None
        tree = blake3()
        try:
            for path in files:
                size, digest = self._file_digest(path)
                tree.update(f"{path.name}\0{size}\0{digest}\n".encode())
        except OSError as exc:
            log.warning("cannot read base model files under %s: %s", root, exc)
            return None
        self._write_cache()
        return tree.hexdigest()

    async def digest_async(self, root: Path) -> str | None:
        async with self._lock:
            return await asyncio.to_thread(self.digest, root)
