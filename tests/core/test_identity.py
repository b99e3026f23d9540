from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.core.errors import InvalidAdapter
from gateway.core.identity import check_logical_id, scan_adapter, tree_digest, versioned_name
from tests.support.adapter_files import MakeAdapter


def digest_of(root: Path) -> str:
    return tree_digest(root, scan_adapter(root))


def test_same_bytes_same_digest_in_any_directory(make_adapter: MakeAdapter) -> None:
    assert digest_of(make_adapter(b"abc")) == digest_of(make_adapter(b"abc"))


def test_any_byte_changes_the_digest(make_adapter: MakeAdapter) -> None:
    assert digest_of(make_adapter(b"abc")) != digest_of(make_adapter(b"abd"))


def test_paths_and_sizes_are_part_of_the_digest(make_adapter: MakeAdapter) -> None:
    a = make_adapter(b"w", extra={"extra/a.bin": b"xy"})
    b = make_adapter(b"w", extra={"extra/b.bin": b"xy"})
    assert digest_of(a) != digest_of(b)


def test_versioned_name_uses_16_hex() -> None:
    assert versioned_name("tenant-42", "0123456789abcdef" * 4) == "tenant-42@0123456789abcdef"


@pytest.mark.parametrize("bad", ["", "a@b", "{x}", "../x", "a/b", "-lead", "x" * 129])
def test_bad_logical_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidAdapter):
        check_logical_id(bad)


def test_symlinked_file_is_refused(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    root = make_adapter()
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", root / "linked.bin")
    with pytest.raises(InvalidAdapter, match="symlink"):
        scan_adapter(root)


def test_symlinked_root_is_refused(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    link = tmp_path / "link"
    os.symlink(make_adapter(), link)
    with pytest.raises(InvalidAdapter, match="symlinks are refused"):
        scan_adapter(link)


def test_fifo_is_refused(make_adapter: MakeAdapter) -> None:
    root = make_adapter()
    os.mkfifo(root / "pipe")
    with pytest.raises(InvalidAdapter, match="non-regular"):
        scan_adapter(root)


def test_missing_config_and_weights_are_refused(make_adapter: MakeAdapter) -> None:
    root = make_adapter()
    (root / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidAdapter, match="safetensors"):
        scan_adapter(root)
    (root / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapter, match=r"adapter_config\.json"):
        scan_adapter(root)


def test_bad_config_json_is_refused(make_adapter: MakeAdapter) -> None:
    root = make_adapter()
    (root / "adapter_config.json").write_text("[1, 2")
    with pytest.raises(InvalidAdapter, match="not valid JSON"):
        scan_adapter(root)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidAdapter, match="missing"):
        scan_adapter(tmp_path / "nope")


def test_odd_file_names_are_refused(make_adapter: MakeAdapter) -> None:
    root = make_adapter(extra={"bad name.bin": b"x"})
    with pytest.raises(InvalidAdapter, match="file name"):
        scan_adapter(root)
