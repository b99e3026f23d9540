"""What publishes killed half way leave in a store, for ``kvgate gc`` to remove.

A publish stages its bytes first: a directory store writes the version into a ``.incoming-*`` directory
and renames it into place; an object store uploads a large file to a random key under ``.incoming/``
and copies it into place. Either removes its staging when it ends, whichever way it ends, unless its
process is killed. What a killed publish leaves is named by no version and no publish comes back for
it; gc removes it once it is older than the retention period (a publish under way writes its staging
now, so it is young: the newest file in a directory counts).

An object store's abandoned multipart uploads are not objects and are not listed here: a bucket
lifecycle rule (``AbortIncompleteMultipartUpload``) removes those, as S3 recommends.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import obstore
from obstore.exceptions import BaseError, NotFoundError

from gateway.adapters.objclient import describe
from gateway.adapters.objstore import INCOMING, ObjectStore
from gateway.adapters.store import INCOMING_PREFIX, AdapterStore
from gateway.core.errors import StoreUnavailable


@dataclass(frozen=True, slots=True)
class Leftover:
    path: str  # a directory, or an object's key
    age_s: float
    bytes: int

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "age_s": round(self.age_s, 1), "bytes": self.bytes}


def leftovers(store: AdapterStore | ObjectStore, older_than: float, now: float) -> list[Leftover]:
    """The staging of killed publishes older than ``older_than`` seconds, oldest first."""
    found = _objects(store, now) if isinstance(store, ObjectStore) else _directories(store, now)
    return sorted((item for item in found if item.age_s >= older_than), key=lambda item: -item.age_s)


def remove(store: AdapterStore | ObjectStore, leftover: Leftover) -> None:
    if isinstance(store, ObjectStore):
        try:
            obstore.delete(store.client, leftover.path)
        except NotFoundError:
            pass  # another gc took it
        except BaseError as exc:
            raise StoreUnavailable(f"cannot delete {store.url}/{leftover.path}: {describe(exc)}") from None
        return
    shutil.rmtree(leftover.path, ignore_errors=True)


def _objects(store: ObjectStore, now: float) -> list[Leftover]:
    try:
        metas = [meta for batch in obstore.list(store.client, prefix=INCOMING) for meta in batch]
    except BaseError as exc:
        raise StoreUnavailable(f"cannot list {store.url}/{INCOMING}: {describe(exc)}") from None
    return [Leftover(str(m["path"]), now - m["last_modified"].timestamp(), int(m["size"])) for m in metas]


def _directories(store: AdapterStore, now: float) -> list[Leftover]:
    if not store.root.is_dir():
        return []
    found = []
    for path in sorted(store.root.glob(INCOMING_PREFIX + "*")):
        try:
            files = [f.stat() for f in path.rglob("*") if f.is_file()]
            newest = max([path.stat().st_mtime, *(f.st_mtime for f in files)])
        except FileNotFoundError:  # its publish just renamed it into place (or another gc took it)
            continue
        found.append(Leftover(str(path), now - newest, sum(f.st_size for f in files)))
    return found
