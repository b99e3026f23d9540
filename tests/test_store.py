from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gateway.adapters.store import INCOMING_PREFIX, AdapterStore
from gateway.core.errors import InvalidAdapter
from tests.conftest import MakeAdapter


def test_ingest_is_content_addressed_and_read_only(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    artifact = store.ingest(make_adapter(b"v1"))
    assert artifact.created
    assert artifact.path == store.root / artifact.digest
    assert (artifact.path / "adapter_model.safetensors").read_bytes() == b"v1"
    for stored in artifact.path.rglob("*"):
        if stored.is_file():  # no write bit for anyone (root ignores the bits, so check the bits)
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
