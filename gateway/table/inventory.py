"""Reading a logical ID's published versions, and forgetting one (for ``kvgate gc``).

``kvg:{epochs}:versions:ID`` maps ``BASE|DIGEST`` to a JSON record ({name, path, base, published_ms}, and
whatever a newer kvgate adds: kept in ``extra``); a digest is always 64 hex, so the base is the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.replies import as_text

_DIGEST_LENGTH = 64


@dataclass(frozen=True, slots=True)
class VersionRecord:
    digest: str
    base: str
    name: str
    path: str
    published_ms: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "digest": self.digest, "base": self.base, "name": self.name,
                "path": self.path, "published_ms": self.published_ms}  # fmt: skip


async def read_ids(table: EpochTable) -> list[str]:
    """Every indexed logical ID (some may have no state: never published, or forgotten)."""
    return sorted(as_text(i) for i in await table.redis.smembers(keys.IDS))


async def read_versions(table: EpochTable, logical_id: str) -> list[VersionRecord]:
    """Every version published for LOGICAL_ID, newest first (by ``published_ms``, then digest)."""
    raw: dict[bytes, bytes] = await table.redis.hgetall(keys.versions(logical_id))  # type: ignore[assignment]
    records = []
    for field_, doc in raw.items():
        name = as_text(field_)
        if len(name) <= _DIGEST_LENGTH or name[-_DIGEST_LENGTH - 1] != "|":
            continue  # not a version field: ignore it rather than fail a whole listing
        record = dict(json.loads(doc))
        records.append(
            VersionRecord(
                digest=name[-_DIGEST_LENGTH:],
                base=name[: -_DIGEST_LENGTH - 1],
                name=str(record.pop("name", "")),
                path=str(record.pop("path", "")),
                published_ms=int(record.pop("published_ms", 0)),
                extra={k: v for k, v in record.items() if k != "base"},
            )
        )
    return sorted(records, key=lambda r: (-r.published_ms, r.digest))


async def forget_version(table: EpochTable, logical_id: str, digest: str) -> bool:
    """Drop DIGEST's version records under LOGICAL_ID (``lua/forget_version.lua``); False, and nothing
    dropped, when DIGEST is its current version."""
    return await table.scripts.forget_version(logical_id, digest)
