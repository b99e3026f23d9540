"""A TOML config file named by ``--config`` or ``KVGATE_CONFIG``, read fail-closed (``config.py`` uses it)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

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
