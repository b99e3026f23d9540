"""The data model every part shares: what a logical ID points at, a table read, a change, a request's target.

Pure values: no I/O. ``VersionState`` is one row of the epoch table; ``Target`` is the effective model
one request meets (a published version in a cache namespace, or the base model).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOKEN_ID_END = 1 << 63
"""Token ids are below this, and not negative: kvgate keys a prompt's blocks by their tokens as signed
64-bit ints (``kv.index.block_keys``)."""


def is_token_id(value: object) -> bool:
    """An int in ``0 .. 2^63 - 1``: a token id kvgate can key (a client may send any int; vLLM does not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < TOKEN_ID_END


def all_token_ids(values: list[Any]) -> bool:
    """Every value ``is_token_id``, checked in C where it can be (a KV event batch carries millions): a
    signed 64-bit array takes only ints below 2^63, its least item says none is negative, and the set of
    types says no bool passed as an int."""
    try:
        packed = array("q", values)  # TypeError / OverflowError: not token ids
    except (TypeError, OverflowError):
        return False
    return (not packed or min(packed) >= 0) and bool not in set(map(type, values))


@dataclass(frozen=True, slots=True)
class Candidate:
    """A rollout's new version beside the current one (``kvgate rollout``): its own bytes, versioned name,
    store path and base; ``weight`` is its share of the ID's traffic in basis points (0..10000); ``split``
    what its requests are split by (``core.split.SPLIT_KEYS``; '' : a rollout stored before split keys
    were, split by the default)."""

    digest: str
    name: str
    path: str
    base: str
    base_print: str
    weight: int
    split: str = ""


WEIGHT_FULL = 10_000
"""A candidate's weight is in basis points: 10,000 is all of the traffic."""


@dataclass(frozen=True, slots=True)
class VersionState:
    """What a logical ID points at right now."""

    logical_id: str
    digest: str
    name: str  # versioned name, e.g. tenant-42@0123456789abcdef
    path: str  # content-addressed store path: the only root a replica may load it from
    base: str  # base model identity the version was published for
    epoch: int
    base_print: str = ""  # fingerprint of that base (core/base_print.py); '' when published without one
    candidate: Candidate | None = None  # a rollout running beside it (at most one)
    last_rollout: str = ""  # how the last rollout ended (JSON: digest, outcome, reason, at_ms); '' : none

    def candidate_version(self) -> VersionState | None:
        """The candidate as a version of its own: its epoch is the one a promote gives it (epoch + 1), so
        its cache namespace is its own and carries over when it is promoted."""
        c = self.candidate
        if c is None:
            return None
        return VersionState(self.logical_id, c.digest, c.name, c.path, c.base, self.epoch + 1, c.base_print)

    def versions(self) -> tuple[VersionState, ...]:
        """The current version, then the candidate when a rollout runs (each served under its own name)."""
        candidate = self.candidate_version()
        return (self, candidate) if candidate is not None else (self,)


@dataclass(frozen=True, slots=True)
class TableView:
    generation: str
    states: dict[str, VersionState]
    malformed: dict[str, str] = field(default_factory=dict)
    """Logical ID -> why its state row could not be read (left out of ``states``; the rest is read)."""


@dataclass(frozen=True, slots=True)
class Change:
    changed: bool
    epoch: int
    digest: str = ""


@dataclass(frozen=True, slots=True)
class RolloutChange:
    """What starting a rollout or changing its weight did (``table.rollouts``)."""

    changed: bool
    epoch: int  # the current version's epoch (the candidate runs in epoch + 1)
    weight: int  # basis points
    split: str = ""  # the rollout's split key in effect ('' : refused, or an older script's answer)


@dataclass(slots=True)
class Target:
    """The effective model a request meets: a published version, or the base model (version None)."""

    logical_id: str
    base: str  # the base model identity the request needs
    version: VersionState | None
    salt: str | None  # the cache namespace the gateway sets (None: the server's default)
    keys: list[bytes]  # prefix block keys, seeded by the cache namespace
    base_print: str = ""  # the base fingerprint a replica must match ('' : any replica of the base)
    tokens: Sequence[int] = ()  # the prompt's leading tokens, when kvgate tokenized it (precise prefix keys)
    role: str = ""  # while a rollout runs: which of its versions this is (core/split.py); '' otherwise
    rollout: str = ""  # while a rollout runs: its candidate's digest (the rollout's figures are keyed by it)
    whole: bool = False  # ``tokens`` are the whole prompt, tokenized by kvgate: the live check compares
    # their count with the replica's usage.prompt_tokens (``kv.live_check``)
