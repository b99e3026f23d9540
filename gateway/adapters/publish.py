"""Publishing a version: validate and store the bytes, then point the logical ID at them.

The store write comes first and is atomic and content-addressed; the epoch table write is one Lua
script. A failure between the two leaves an unreferenced store directory and no visible version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.adapters.store import AdapterStore
from gateway.core.identity import check_logical_id, versioned_name
from gateway.core.model import Change
from gateway.table.epoch_table import EpochTable


@dataclass(frozen=True, slots=True)
class Published:
    logical_id: str
    digest: str
    name: str
    path: Path
    change: Change


async def publish_adapter(
    table: EpochTable, store: AdapterStore, logical_id: str, adapter_dir: Path, base: str
) -> Published:
    check_logical_id(logical_id)
    artifact = store.ingest(adapter_dir)
    name = versioned_name(logical_id, artifact.digest)
    change = await table.publish(logical_id, artifact.digest, name, str(artifact.path), base)
    return Published(logical_id, artifact.digest, name, artifact.path, change)
