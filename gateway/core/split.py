"""The sticky split of a rollout: which version, current or candidate, answers one request.

Pure and the same in every kvgate: a request goes to the candidate when a stable hash of (logical ID,
split key) falls below the candidate's weight. The hash is blake3 of the ID and the key; its first 8
bytes, taken mod ``WEIGHT_FULL``, give the key's *point* in 0..9999 basis points. A key's point never
changes, so raising the weight only moves keys from the current version to the candidate (the
candidate's keys at weight W are a subset of those at any weight above W), and every kvgate process
decides the same way with no coordination.

The split key, in order: the request's OpenAI ``user`` field; the caller's API key (its key id); the
first prefix block of the prompt (``prefix.BLOCK_CHARS`` characters: requests that share a prefix share a
version, and so its cache). Each names its kind, so a ``user`` never lands where the same text as a
prompt would. A request with none of them (no prompt at all) splits on the empty key: one version for
all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from gateway.core.model import WEIGHT_FULL, VersionState
from gateway.core.prefix import BLOCK_CHARS

CURRENT, CANDIDATE = "current", "candidate"
ROLES = (CURRENT, CANDIDATE)
"""A version's role in its ID's rollout: the label of the per-version metrics (bounded cardinality)."""


@dataclass(frozen=True, slots=True)
class Split:
    version: VersionState  # what answers: the current version or the candidate (as a version of its own)
    role: str  # CURRENT or CANDIDATE
    key_kind: str  # user, api-key, prefix or none: which split key decided ('' : no rollout runs)
    rollout: str = ""  # the running rollout's candidate digest ('' : none runs)


def split_key(body: dict[str, Any], key_id: str | None, prompt: str) -> tuple[str, str]:
    """(kind, key): the request's ``user`` field, else the caller's API key id, else its first block."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user", user
    if key_id:
        return "api-key", key_id
    if prompt:
        return "prefix", prompt[:BLOCK_CHARS]
    return "none", ""


def point(logical_id: str, kind: str, key: str) -> int:
    """The key's fixed point in 0..WEIGHT_FULL-1: below the candidate's weight, the candidate answers."""
    digest = blake3(b"kvgate-split\0" + logical_id.encode(errors="surrogateescape") + b"\0"
                    + kind.encode() + b"\0" + key.encode(errors="surrogateescape")).digest(8)  # fmt: skip
    return int.from_bytes(digest, "big") % WEIGHT_FULL


def choose(state: VersionState, body: dict[str, Any], key_id: str | None, prompt: str) -> Split:
    """Which version of STATE answers this request."""
    candidate = state.candidate_version()
    if candidate is None or state.candidate is None:
        return Split(state, CURRENT, "")
    kind, key = split_key(body, key_id, prompt)
    if point(state.logical_id, kind, key) < state.candidate.weight:
        return Split(candidate, CANDIDATE, kind, candidate.digest)
    return Split(state, CURRENT, kind, candidate.digest)


def rollout_view(state: VersionState) -> dict[str, Any] | None:
    """A running rollout as JSON (None: none runs), with how the last one ended."""
    last = json.loads(state.last_rollout) if state.last_rollout else None
    c = state.candidate
    if c is None:
        return None if last is None else {"running": False, "last": last}
    return {"running": True, "candidate": {"digest": c.digest, "name": c.name, "path": c.path,
            "base": c.base, "epoch": state.epoch + 1, "weight": c.weight, "percent": c.weight / 100},
            "current": {"digest": state.digest, "name": state.name, "epoch": state.epoch},
            "last": last}  # fmt: skip
