"""The data model every part shares: what a logical ID points at, a table read, a change, a request's target.

Pure values: no I/O. ``VersionState`` is one row of the epoch table; ``Target`` is the effective model
one request meets (a published version in a cache namespace, or the base model).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
class Target:
    """The effective model a request meets: a published version, or the base model (version None)."""

    logical_id: str
    base: str  # the base model identity the request needs
    version: VersionState | None
    salt: str | None  # the cache namespace the gateway sets (None: the server's default)
    keys: list[bytes]  # prefix block keys, seeded by the cache namespace
    base_print: str = ""  # the base fingerprint a replica must match ('' : any replica of the base)
