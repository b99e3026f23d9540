"""The Lua scripts the epoch table runs: where they are, how one is assembled, and their status codes.

Each operation ``lua/NAME.lua`` runs with ``lua/lib/common.lua`` prepended (``assemble_script``;
``kvgate script NAME`` prints the same text for ``redis-cli --eval``). The status codes are the lib's
``CODE`` table, which ``codes()`` reads from that same file.
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from gateway.core.errors import BadRequest, EpochTableError


def lua_dir() -> Traversable:
    """``lua/`` beside the package in a source tree; ``gateway/lua`` inside an installed wheel."""
    source_tree = Path(__file__).resolve().parents[2] / "lua"
    if source_tree.is_dir():
        return source_tree
    return resources.files("gateway.lua")


LIB = ("lib", "common.lua")
"""Prepended to every operation: the CODE table and the helpers the scripts share (not an operation)."""


def lib_source() -> str:
    folder, name = LIB  # one joinpath a step: an installed gateway.lua is a namespace package's path
    return lua_dir().joinpath(folder).joinpath(name).read_text()


def operation_names() -> list[str]:
    """Every operation script: each ``lua/*.lua`` (the lib lives in a subfolder)."""
    return sorted(
        entry.name.removesuffix(".lua")
        for entry in lua_dir().iterdir()
        if entry.is_file() and entry.name.endswith(".lua")
    )


def assemble_script(name: str) -> str:
    """The self-contained text Redis runs for operation NAME: the lib, then ``lua/NAME.lua``."""
    if name not in operation_names():
        raise BadRequest(f"no epoch table script {name!r}; one of {', '.join(operation_names())}")
    operation = lua_dir().joinpath(f"{name}.lua").read_text()
    banner = f"-- kvgate script {name}: lua/{'/'.join(LIB)}, then lua/{name}.lua\n"
    return f"{banner}{lib_source()}\n{operation}"


_CODE_TABLE = re.compile(r"^local CODE = \{\n(?P<body>.*?)^\}", re.MULTILINE | re.DOTALL)
_CODE_ENTRY = re.compile(r"(?P<name>[A-Z][A-Z_]*)\s*=\s*(?P<value>-?\d+)\s*,?")


def parse_codes(lua: str) -> Mapping[str, int]:
    """The ``local CODE = {NAME = number, ...}`` table of the lib, one entry a line (``--`` comments)."""
    table = _CODE_TABLE.search(lua)
    if table is None:
        raise EpochTableError("the Lua lib has no `local CODE = {...}` table")
    found: dict[str, int] = {}
    for line in table["body"].splitlines():
        text = line.split("--", 1)[0].strip()
        if not text:
            continue
        entry = _CODE_ENTRY.fullmatch(text)
        if entry is None or entry["name"] in found:
            raise EpochTableError(f"cannot read Lua CODE entry {text!r}")
        found[entry["name"]] = int(entry["value"])
    if len(set(found.values())) != len(found):
        raise EpochTableError(f"Lua CODE values are not distinct: {found}")
    return types.MappingProxyType(found)


@functools.cache
def codes() -> Mapping[str, int]:
    """The scripts' status codes by name, read from the lib (the one place they are written)."""
    return parse_codes(lib_source())
