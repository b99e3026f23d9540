"""The local snapshot: what counts as a change of effective model or namespace."""

from __future__ import annotations

from gateway.core.model import TableView, VersionState
from gateway.table.snapshot import Snapshot


def state(digest: str, epoch: int) -> VersionState:
    return VersionState(
        "tenant-42", digest * 64, f"tenant-42@{digest * 16}", f"/store/{digest}", "base", epoch
    )


def test_epoch_changes_and_new_generations_reach_the_hook() -> None:
    changed: list[str] = []
    snapshot = Snapshot(on_epoch_change=changed.append)
    snapshot.replace(TableView("g1", {"tenant-42": state("a", 1)}))
    assert changed == []  # the first read is not a change
    snapshot.put("tenant-42", state("a", 2))
    assert changed == ["tenant-42"]
    snapshot.replace(TableView("g2", {"tenant-42": state("a", 1)}))  # Redis came back empty: epochs restart
    assert changed == ["tenant-42", "tenant-42"]
    assert snapshot.get("tenant-42") == state("a", 1)
    assert snapshot.generation == "g2"


def test_a_new_version_retires_the_old_name_and_a_gone_id_retires_its_own() -> None:
    snapshot = Snapshot()
    snapshot.replace(TableView("g1", {"tenant-42": state("a", 1)}))
    snapshot.put("tenant-42", state("b", 2))
    assert set(snapshot.retired) == {"tenant-42@" + "a" * 16}
    snapshot.replace(TableView("g1", {}))
    assert set(snapshot.retired) == {"tenant-42@" + "a" * 16, "tenant-42@" + "b" * 16}
    assert snapshot.get("tenant-42") is None
