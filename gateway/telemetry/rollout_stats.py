"""Per-version figures of each running rollout: requests, errors, time to first byte, by role.

The proxy counts every request of an ID whose rollout runs under its role (``core.split``: current or
candidate) and the candidate it ran beside. These are this worker's own; what it counted since it last
shared them is ``pending``, which the gate adds to the rollout's fleet-wide figures in Redis at each of
its ticks (``table/rollout_gate.py``), and the gate compares the fleet's two error rates
(``proof/gate.py``); ``/kvgate/status`` shows both. Memory is bounded by the running rollouts: a
rollout's figures are dropped once it ends (``keep``). Errors are the answers a caller did not cause:
5xx, kvgate's own upstream and availability errors; a 4xx (bad input, not found) is no fault of the
version.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.model import Target
from gateway.core.split import ROLES

FIGURES = ("requests", "errors", "first_bytes", "first_byte_us")
"""What is counted per role, each a whole number (the time to first byte in microseconds, summed)."""


@dataclass
class VersionFigures:
    requests: int = 0
    errors: int = 0
    first_bytes: int = 0  # requests whose first byte came (the TTFB mean's count)
    first_byte_us: int = 0  # their total time to first byte, in microseconds

    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def add(self, other: VersionFigures) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.first_bytes += other.first_bytes
        self.first_byte_us += other.first_byte_us

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIGURES}

    def to_json(self) -> dict[str, float | int | None]:
        mean = self.first_byte_us / self.first_bytes / 1e6 if self.first_bytes else None
        return {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate(),
                "ttfb_mean_s": mean}  # fmt: skip


def by_role() -> dict[str, VersionFigures]:
    return {role: VersionFigures() for role in ROLES}


@dataclass
class _Counted:
    own: dict[str, VersionFigures] = field(default_factory=by_role)  # all this worker counted
    pending: dict[str, VersionFigures] = field(default_factory=by_role)  # not yet shared


class RolloutStats:
    def __init__(self) -> None:
        self._figures: dict[tuple[str, str], _Counted] = {}
        """(logical ID, candidate digest) -> this worker's figures, and what it has not shared yet."""

    def _of(self, target: Target) -> tuple[VersionFigures, VersionFigures]:
        counted = self._figures.setdefault((target.logical_id, target.rollout), _Counted())
        return counted.own[target.role], counted.pending[target.role]

    def first_byte(self, target: Target, seconds: float) -> None:
        """A request of a running rollout (``target.role`` set) got its first byte after SECONDS."""
        for figures in self._of(target):
            figures.first_bytes += 1
            figures.first_byte_us += round(seconds * 1e6)

    def finished(self, target: Target, *, error: bool) -> None:
        for figures in self._of(target):
            figures.requests += 1
            figures.errors += int(error)

    def figures(self, logical_id: str, candidate_digest: str) -> dict[str, VersionFigures]:
        """This worker's own figures of the rollout."""
        counted = self._figures.get((logical_id, candidate_digest))
        return counted.own if counted is not None else by_role()

    def take_pending(self, logical_id: str, candidate_digest: str) -> dict[str, VersionFigures]:
        """What this worker counted of the rollout since it last shared it, now taken (``give_back``
        when sharing it failed)."""
        counted = self._figures.get((logical_id, candidate_digest))
        if counted is None:
            return by_role()
        taken, counted.pending = counted.pending, by_role()
        return taken

    def give_back(self, logical_id: str, candidate_digest: str, taken: dict[str, VersionFigures]) -> None:
        counted = self._figures.setdefault((logical_id, candidate_digest), _Counted())
        for role, figures in taken.items():
            counted.pending[role].add(figures)

    def keep(self, running: dict[str, str]) -> None:
        """Forget every rollout not in RUNNING (logical ID -> candidate digest)."""
        for key in list(self._figures):
            if running.get(key[0]) != key[1]:
                del self._figures[key]
