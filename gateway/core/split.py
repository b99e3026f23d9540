"""The sticky split of a rollout: which version, current or candidate, answers one request.

Pure and the same in every kvgate: a request goes to the candidate when a stable hash of (logical ID,
split key) falls below the candidate's weight. The hash is blake3 of the ID and the key; its first 8
bytes, taken mod ``WEIGHT_FULL``, give the key's *point* in 0..9999 basis points. A key's point never
changes, so raising the weight only moves keys from the current version to the candidate (the
candidate's keys at weight W are a subset of those at any weight above W), and every kvgate process
decides the same way with no coordination: the later turns of a conversation keep their version through
any kvgate.

The operator chooses the split key per rollout (``kvgate rollout --split-key``, ``SPLIT_KEYS``); each
falls back to a finer one where the request lacks it:

- ``user`` (the default): the request's OpenAI ``user`` field, else its conversation;
- ``conversation``: its conversation, whatever the ``user`` field says;
- ``api-key``: the caller's API key (its key id: all of a key's traffic on one version), else as ``user``.

A request's *conversation* (``conversation``) is what stays the same on its later turns and differs
between conversations: for chat (``messages``; the Responses API's ``input`` items) its opening, the
top-level system prompt (``system``, ``instructions``) and the messages up to and including the first
user message; for a completion (``prompt``; a plain ``input``) the prompt's first ``PROMPT_CHARS``
characters (a token-id prompt in its canonical rendering). Only that leading part of a body is read:
``OPENING_MESSAGES`` messages of ``OPENING_CHARS`` characters each at most, whatever the body's size.
A request with none of it (no prompt at all) splits on the empty key: one version for all of them.
Each key names its kind in the hash, so a ``user`` never lands where the same text as a prompt would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from gateway.core.model import WEIGHT_FULL, VersionState
from gateway.core.prefix import BLOCK_CHARS, prompt_text

CURRENT, CANDIDATE = "current", "candidate"
ROLES = (CURRENT, CANDIDATE)
"""A version's role in its ID's rollout: the label of the per-version metrics (bounded cardinality)."""

USER, API_KEY, CONVERSATION = "user", "api-key", "conversation"
SPLIT_KEYS = (USER, API_KEY, CONVERSATION)
"""What an operator may split a rollout by (``kvgate rollout --split-key``; the state's ``cand_split``)."""
DEFAULT_SPLIT = USER
"""A rollout's split key when the operator names none (and a rollout stored before they were)."""

OPENING_MESSAGES = 16
"""Messages of a chat's opening read at most (a first user message past them is not looked for)."""
OPENING_CHARS = 4096
"""Characters of each opening message (and top-level system prompt) the key covers."""
PROMPT_CHARS = 8 * BLOCK_CHARS
"""Characters of a completion's prompt the key covers (2 KiB): past a short shared preamble, within a
conversation's first prompt when that prompt is at least as long (a transcript re-sent on each turn)."""


@dataclass(frozen=True, slots=True)
class Split:
    version: VersionState  # what answers: the current version or the candidate (as a version of its own)
    role: str  # CURRENT or CANDIDATE
    key_kind: str  # user, api-key or conversation: which split key decided ('' : no rollout runs)
    rollout: str = ""  # the running rollout's candidate digest ('' : none runs)


def split_key(body: dict[str, Any], key_id: str | None, by: str = DEFAULT_SPLIT) -> tuple[str, str]:
    """(kind, key) of a request for a rollout split BY one of ``SPLIT_KEYS`` (each falls back to the
    finer ones: the API key, then ``user``, then the conversation)."""
    if by == API_KEY and key_id:
        return API_KEY, key_id
    user = body.get("user")
    if by != CONVERSATION and isinstance(user, str) and user:
        return USER, user
    return CONVERSATION, conversation(body)


def conversation(body: dict[str, Any]) -> str:
    """What identifies the request's conversation across its turns (the module's docstring), bounded."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        items = body.get("input")  # the Responses API: a text, or items shaped like messages
        messages = items if isinstance(items, list) and items and isinstance(items[0], dict) else None
    if messages is None:
        prompt = body.get("prompt", body.get("input"))
        return "" if prompt is None else prompt_text({"prompt": prompt}, PROMPT_CHARS)
    opening = [_text(body[name]) for name in ("system", "instructions") if body.get(name)]
    for message in messages[:OPENING_MESSAGES]:
        if not isinstance(message, dict):
            opening.append(_text(message))
            continue
        role = message.get("role")
        opening += [_text(role), _text(message.get("content"))]
        if role == "user":
            break
    return json.dumps(opening, ensure_ascii=False)


def _text(value: object) -> str:
    """VALUE as text, its first ``OPENING_CHARS`` characters (content parts in their canonical JSON)."""
    return prompt_text({"prompt": value}, OPENING_CHARS)


def point(logical_id: str, kind: str, key: str) -> int:
    """The key's fixed point in 0..WEIGHT_FULL-1: below the candidate's weight, the candidate answers."""
    digest = blake3(b"kvgate-split\0" + logical_id.encode(errors="surrogateescape") + b"\0"
                    + kind.encode() + b"\0" + key.encode(errors="surrogateescape")).digest(8)  # fmt: skip
    return int.from_bytes(digest, "big") % WEIGHT_FULL


def choose(state: VersionState, body: dict[str, Any], key_id: str | None) -> Split:
    """Which version of STATE answers this request (its split key as the rollout says)."""
    candidate = state.candidate_version()
    if candidate is None or state.candidate is None:
        return Split(state, CURRENT, "")
    kind, key = split_key(body, key_id, state.candidate.split or DEFAULT_SPLIT)
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
            "split_key": c.split or DEFAULT_SPLIT, "last": last}  # fmt: skip
