"""The base's bytes fingerprint: config, tokenizer and weights, cached by (path, size, mtime) on disk."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.fleet.base_bytes import CACHE_FILE, BaseBytes


def make_base(root: Path, weights: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "tokenizer.json").write_text('{"model": {}}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "README.md").write_text("not part of the base")
    return root


def test_a_restart_over_unchanged_files_reads_nothing_and_a_copy_over_is_hashed_again(
    tmp_path: Path,
) -> None:
    base = make_base(tmp_path / "model", b"w" * 3_000_000)
    cache = tmp_path / "data" / CACHE_FILE
    first = BaseBytes(cache)
    digest = first.digest(base)
    assert digest is not None
    assert first.hashed_bytes > 3_000_000

    (base / "README.md").write_text("edited: not a base file")
    restarted = BaseBytes(cache)  # kvgate restarted: the cache file is all it has
    assert restarted.digest(base) == digest
    assert restarted.hashed_bytes == 0, "unchanged files are not read again"

    (base / "model.safetensors").write_bytes(b"v" * 3_000_000)  # a checkpoint copied over: same size
    os.utime(base / "model.safetensors", ns=(1, 1))  # whatever the clock did, the mtime differs
    other = restarted.digest(base)
    assert other is not None
    assert other != digest
    assert restarted.hashed_bytes == 3_000_000, "only the changed file is read"


def test_no_base_files_or_no_directory_gives_no_digest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    bytes_ = BaseBytes(None)
    assert bytes_.digest(tmp_path / "empty") is None
    assert bytes_.digest(tmp_path / "missing") is None
    corrupt = tmp_path / CACHE_FILE
    corrupt.write_text("{not json")
    assert BaseBytes(corrupt).digest(make_base(tmp_path / "m", b"x")) is not None, (
        "a corrupt cache is ignored"
    )
