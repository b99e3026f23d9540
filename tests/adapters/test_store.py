from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import INCOMING_PREFIX, AdapterStore
from gateway.core.errors import InvalidAdapter
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter


def test_ingest_is_content_addressed_and_read_only(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    artifact = store.ingest(make_adapter(b"v1"))
    assert artifact.created
    assert artifact.path == store.root / artifact.digest
    assert (artifact.path / "adapter_model.safetensors").read_bytes() == b"v1"
    files = [stored for stored in artifact.path.rglob("*") if stored.is_file()]
    assert {f.name for f in files} == {"adapter_config.json", "adapter_model.safetensors"}
    for stored in files:  # no write bit for anyone (root ignores the bits, so check the bits)
        assert stat.S_IMODE(stored.stat().st_mode) == 0o444, stored


def test_same_bytes_again_is_a_no_op(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    first = store.ingest(make_adapter(b"v1"))
    again = store.ingest(make_adapter(b"v1"))
    assert (again.digest, again.created) == (first.digest, False)
    assert sorted(p.name for p in store.root.iterdir()) == [first.digest]


def test_invalid_directory_writes_nothing(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    root = make_adapter()
    (root / "adapter_config.json").unlink()
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(InvalidAdapter):
        store.ingest(root)
    assert not store.root.exists()


def test_failure_mid_copy_leaves_no_staging(
    make_adapter: MakeAdapter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path / "store")
    store.ingest(make_adapter(b"v1"))

    def broken_rename(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "rename", broken_rename)
    with pytest.raises(OSError, match="disk full"):
        store.ingest(make_adapter(b"v2"))
    assert not [p for p in store.root.iterdir() if p.name.startswith(INCOMING_PREFIX)]
    assert len(list(store.root.iterdir())) == 1


def test_stored_directories_are_readable_by_every_user(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    """A replica running as another user must read the store: directories 0755, files 0444."""
    store = AdapterStore(tmp_path / "store")
    artifact = store.ingest(make_adapter(b"v1", extra={"sub/dir/tokenizer.json": b"{}"}))
    assert stat.S_IMODE(artifact.path.stat().st_mode) == 0o755
    modes = {
        path.relative_to(artifact.path).as_posix(): stat.S_IMODE(path.stat().st_mode)
        for path in artifact.path.rglob("*")
    }
    assert modes == {"adapter_config.json": 0o444, "adapter_model.safetensors": 0o444, "sub": 0o755,
                     "sub/dir": 0o755, "sub/dir/tokenizer.json": 0o444}  # fmt: skip


def sparse_adapter(make_adapter: MakeAdapter, size: int) -> Path:
    """An adapter whose weight file is SIZE bytes long but holds no data (a sparse file)."""
    root = make_adapter(b"")
    with open(root / "adapter_model.safetensors", "r+b") as weights:
        weights.truncate(size)
    return root


def test_an_adapter_over_max_adapter_bytes_is_refused_before_anything_is_copied(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store", max_bytes=1 << 20)
    with pytest.raises(InvalidAdapter, match="max_adapter_bytes"):
        store.ingest(sparse_adapter(make_adapter, 1 << 30))
    assert not store.root.exists()
    assert store.ingest(sparse_adapter(make_adapter, 1 << 19)).created, "under the limit is fine"


def test_a_file_that_grows_while_copied_is_refused(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    """The limit holds while copying too: only the bytes the manifest counted are ever read."""
    store = AdapterStore(tmp_path / "store", max_bytes=1 << 20)
    source = make_adapter(b"v1")
    manifest = store.scan(source)
    (source / "adapter_model.safetensors").write_bytes(b"v1" * 1000)  # grows after the scan
    with pytest.raises(InvalidAdapter, match="changed while"):
        store.ingest(source, manifest)
    assert [p for p in store.root.iterdir()] == []


async def test_a_failed_table_write_removes_only_what_this_publish_stored(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    earlier = await publish_adapter(table, store, "tenant-a", make_adapter(b"shared"), "base")
    await redis.set(keys.state("tenant-b"), "not a hash")  # the publish script fails on this key
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await publish_adapter(table, store, "tenant-b", make_adapter(b"new bytes"), "base")
    assert sorted(p.name for p in store.root.iterdir()) == [earlier.digest], "its own new bytes are gone"
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await publish_adapter(table, store, "tenant-b", make_adapter(b"shared"), "base")
    assert store.contains(earlier.digest), "bytes another version points at stay"
