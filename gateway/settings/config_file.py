"""Reading a named TOML config file, and saying in one line why settings were refused."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.core.errors import BadRequest


def read_config_file(path: Path) -> dict[str, Any]:
    """The settings a named TOML config file holds; any reason it cannot be read is a ``BadRequest``
    naming the file (fail closed: a file that is not read must never mean the defaults)."""

    def refused(why: str) -> BadRequest:
        return BadRequest(f"config file {path}: {why}", param="config")

    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise refused("does not exist") from None
    except IsADirectoryError:
        raise refused("is a directory, not a file") from None
    except PermissionError:
        raise refused("cannot be read (permission denied)") from None
    except OSError as exc:
        raise refused(f"cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refused(f"is not UTF-8 text (byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise refused(f"is not valid TOML ({exc})") from None


def describe_invalid(exc: ValidationError, settings: Collection[str] = ()) -> str:
    """One line for an operator: each refused setting and why (never the value: it may be a secret);
    a key that is no setting with the nearest of ``settings``."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        why = " ".join(error["msg"].removeprefix("Value error, ").split())
        nearest = difflib.get_close_matches(where, settings, n=1)
        if error["type"] == "extra_forbidden" and nearest:
            why = f"not a kvgate setting (did you mean {nearest[0]}?)"
        problems.append(f"{where}: {why}" if where else why)
    return "invalid settings: " + "; ".join(problems)
