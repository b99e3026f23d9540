"""Synthetic adapter directories and the shapes of the fixtures that make and publish them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

MakeAdapter = Callable[..., Path]

Publish = Callable[[str, bytes], Awaitable[str]]


def swap_bytes(path: Path, source: Path) -> dict[str, bytes]:
    """Write ``source``'s files over the store directory ``path`` (as a divergent volume would show)."""
    saved = {f.name: f.read_bytes() for f in path.iterdir()}
    for name in saved:
        (path / name).chmod(0o644)
        if (source / name).is_file():
            (path / name).write_bytes((source / name).read_bytes())
    return saved


def swap_back(path: Path, saved: dict[str, bytes]) -> None:
    for name, data in saved.items():
        (path / name).write_bytes(data)
        (path / name).chmod(0o444)
