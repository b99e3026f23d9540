"""A state hash as the scripts write it, read back: ``parse_state`` (the snapshot, the change log, a full
read) and ``row_hash`` (what the table's check sums; lua/lib/common.lua's ``row_hash`` computes the same);
a history entry (lua/lib/common.lua's ``append_event``), one at a time: ``parse_history_event``.

A rollout's candidate sits in the same hash (``cand_*`` fields, all or none: lua/rollout_version.lua;
``cand_split`` beside them, absent in rollouts stored before it), and hashes into the row only when
present, so a row without one hashes as it did before rollouts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from gateway.core.errors import MalformedRow
from gateway.core.model import WEIGHT_FULL, Candidate, VersionState
from gateway.core.split import SPLIT_KEYS

_EPOCH = re.compile(rb"[0-9]{1,18}")
_WEIGHT = re.compile(rb"0|[1-9][0-9]{0,4}")
_STATE_FIELDS = (b"digest", b"name", b"path", b"base")
CANDIDATE_FIELDS = (
    b"cand_digest",
    b"cand_name",
    b"cand_path",
    b"cand_base",
    b"cand_base_print",
    b"cand_weight",
)
"""lua/lib/common.lua's CANDIDATE_FIELDS, in the same order (the row hash depends on it): all or none."""
CANDIDATE_SPLIT = b"cand_split"
"""lua/lib/common.lua's last candidate field, the rollout's split key: absent in a rollout stored before
split keys were (the default), and then not in the row's hash either."""


def parse_state(logical_id: str, raw: dict[bytes, bytes]) -> VersionState | None:
    """One state hash as the scripts write it (None: the ID has no state); ``MalformedRow`` when it is
    not one: a field missing or not UTF-8, an epoch that is not a whole number, half a candidate."""
    if not raw or b"digest" not in raw:
        return None
    try:
        logical_id.encode()
    except UnicodeEncodeError:
        raise MalformedRow(f"logical ID {logical_id!r} is not UTF-8") from None
    text: dict[bytes, str] = {}
    for name in (*_STATE_FIELDS, b"base_print"):
        value = raw.get(name, b"" if name == b"base_print" else None)
        if value is None:
            raise MalformedRow(f"state of {logical_id!r} has no {name.decode()!r}")
        text[name] = _utf8(logical_id, name, value)
    epoch = raw.get(b"epoch")
    if epoch is None or not _EPOCH.fullmatch(epoch):
        raise MalformedRow(f"state of {logical_id!r}: epoch {epoch!r} is not a whole number")
    return VersionState(logical_id=logical_id, digest=text[b"digest"], name=text[b"name"],
                        path=text[b"path"], base=text[b"base"], epoch=int(epoch),
                        base_print=text[b"base_print"], candidate=_candidate(logical_id, raw),
                        last_rollout=_last_rollout(raw.get(b"last_rollout", b"")))  # fmt: skip


def _candidate(logical_id: str, raw: dict[bytes, bytes]) -> Candidate | None:
    present = [name for name in CANDIDATE_FIELDS if name in raw]
    if not present:
        return None
    if len(present) != len(CANDIDATE_FIELDS):
        missing = ", ".join(n.decode() for n in CANDIDATE_FIELDS if n not in raw)
        raise MalformedRow(f"state of {logical_id!r}: half a rollout candidate (no {missing})")
    weight = raw[b"cand_weight"]
    if not _WEIGHT.fullmatch(weight) or int(weight) > WEIGHT_FULL:
        raise MalformedRow(f"state of {logical_id!r}: candidate weight {weight!r} is not 0..{WEIGHT_FULL}")
    digest, name, path, base, base_print = (_utf8(logical_id, f, raw[f]) for f in CANDIDATE_FIELDS[:5])
    split = raw.get(CANDIDATE_SPLIT)
    if split is not None and split.decode(errors="replace") not in SPLIT_KEYS:
        raise MalformedRow(
            f"state of {logical_id!r}: split key {split!r} is not one of {', '.join(SPLIT_KEYS)}"
        )
    return Candidate(digest, name, path, base, base_print, int(weight), split.decode() if split else "")


def _last_rollout(value: bytes) -> str:
    """The last rollout's outcome as written (JSON); anything else reads as none (it decides nothing)."""
    try:
        doc = json.loads(value.decode()) if value else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return ""
    return json.dumps(doc, sort_keys=True) if isinstance(doc, dict) else ""


def _utf8(logical_id: str, name: bytes, value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise MalformedRow(f"state of {logical_id!r}: {name.decode()!r} is not UTF-8") from None


_HISTORY_TEXT = ("action", "digest", "base", "role", "reason", "split")
_HISTORY_NUMBERS = ("epoch", "weight")
_AT_MS_END = 253_402_300_800_000  # 10000-01-01: a time past this cannot be printed as a date


def parse_history_event(logical_id: str, position: int, raw: bytes | str) -> dict[str, Any]:
    """One history entry (JSON ``{epoch, digest, base, action, at_ms}``, a rollout's with ``role``,
    ``weight``, ``reason`` and (when it started) ``split``; whatever else a newer kvgate adds is kept),
    or ``MalformedRow`` naming the ID and the entry's position (0: the newest) when it is not one: not
    UTF-8 JSON, not an object, a known field of another type, a time that is no date."""
    where = f"history of {logical_id!r}, entry {position}"
    try:
        event = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MalformedRow(f"{where}: not UTF-8 JSON") from None
    if not isinstance(event, dict):
        raise MalformedRow(f"{where}: not a JSON object")
    for name in _HISTORY_TEXT:
        if not isinstance(event.get(name, ""), str):
            raise MalformedRow(f"{where}: {name} is not a string")
    for name in (*_HISTORY_NUMBERS, "at_ms"):
        value = event.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise MalformedRow(f"{where}: {name} is not a number")
    if not 0 <= event.get("at_ms", 0) < _AT_MS_END:
        raise MalformedRow(f"{where}: at_ms {event['at_ms']} is not a time")
    return event


def row_hash(state: VersionState) -> int:
    """40 bits of a SHA-1 of what a snapshot holds of an ID (lua/lib/common.lua's ``row_hash``)."""
    fields = [state.logical_id, state.digest, str(state.epoch), state.base, state.name, state.path,
              state.base_print]  # fmt: skip
    if (c := state.candidate) is not None:
        fields += [c.digest, c.name, c.path, c.base, c.base_print, str(c.weight)]
        fields += [c.split] if c.split else []
    return int(hashlib.sha1("\n".join(fields).encode()).hexdigest()[:10], 16)
