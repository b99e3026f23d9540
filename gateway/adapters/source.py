"""Where ``kvgate publish`` reads an adapter from: a local directory, or an object-store prefix
(``s3://BUCKET/PATH/``, e.g. a training pipeline's output), downloaded first into a private temporary
directory and then published from there like any directory (validated, digested, stored).

The download is refused from the listing, before a byte is read, when it is larger than
``max_adapter_bytes`` or holds more files than an adapter may; each object's key must be a safe relative
path (no traversal) and is written no larger than the listing said.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import obstore
from obstore.exceptions import BaseError

from gateway.adapters.objclient import describe, is_object_url, open_client
from gateway.core.errors import InvalidAdapter, StoreUnavailable
from gateway.core.identity import MAX_FILES

_PART = re.compile(r"[A-Za-z0-9._-]+")


@contextlib.contextmanager
def local_source(location: str | Path, *, max_bytes: int) -> Iterator[Path]:
    """LOCATION as a local directory for as long as the block runs."""
    if not (isinstance(location, str) and is_object_url(location)):
        yield Path(location)
        return
    staging = Path(tempfile.mkdtemp(prefix="kvgate-source-"))
    try:
        target = staging / "adapter"
        download(location, target, max_bytes=max_bytes)
        yield target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download(url: str, target: Path, *, max_bytes: int) -> None:
    client = open_client(url.rstrip("/"))
    try:
        listed = [(str(m["path"]), int(m["size"])) for batch in obstore.list(client) for m in batch]
    except BaseError as exc:
        raise StoreUnavailable(f"cannot list {url}: {describe(exc)}") from None
    if not listed:
        raise InvalidAdapter(f"{url!r} holds no objects", param="adapter_dir")
    if len(listed) > MAX_FILES:
        raise InvalidAdapter(f"{url!r} holds more than {MAX_FILES} objects: not an adapter")
    total = sum(size for _, size in listed)
    if total > max_bytes:
        raise InvalidAdapter(f"{url!r} holds {total} bytes, over max_adapter_bytes ({max_bytes})")
    for key, size in listed:
        if not all(_PART.fullmatch(part) and part not in {".", ".."} for part in key.split("/")):
            raise InvalidAdapter(f"refusing object name {key!r} in {url!r}")
        dest = target / key
        dest.parent.mkdir(parents=True, exist_ok=True)
        written = 0
        try:
            with open(dest, "xb") as out:
                for chunk in obstore.get(client, key):
                    written += len(chunk)
                    if written > size:
                        raise InvalidAdapter(f"{key!r} in {url!r} grew while it was being downloaded")
                    out.write(chunk)
        except FileNotFoundError:
            raise InvalidAdapter(f"{key!r} in {url!r} went away while it was being downloaded") from None
        except BaseError as exc:
            raise StoreUnavailable(f"reading {key!r} in {url!r} failed: {describe(exc)}") from None
