"""Writing a file whole: a reader sees the old file or the new one, never part of either.

``write_atomically`` writes the bytes to a temporary file of this writer's own in the file's directory
(hidden; the pid and a random suffix in its name, so any number of processes may write the same file),
fsyncs it, renames it over the file (``os.replace``: atomic on POSIX, and the same directory keeps it on
one filesystem), then fsyncs the directory so the rename itself is on disk. When a step fails the
temporary file is removed and the file is as it was; of two writers the last rename wins.

``durable=False`` skips both fsyncs, for a file only running processes read, written on the event loop
(a worker's ``/metrics`` page, every second): it is still whole, it may just not survive a power loss.
``fsync_directory`` is the last step on its own, for a caller that renames a directory into place.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """DATA as the file at PATH, whole or not at all (its directory must exist)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        with contextlib.suppress(OSError):  # the file is in place; not every filesystem syncs a directory
            fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """The directory's entries on disk: a rename (or a create, a delete) in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
