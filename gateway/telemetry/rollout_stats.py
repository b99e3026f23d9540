"""Per-version figures of each running rollout: requests, errors, time to first byte, by role.

The proxy counts every request of an ID whose rollout runs under its role (``core.split``: current or
candidate) and the candidate it ran beside; the gate (``proof/gate.py``) compares the two error rates,
and ``/kvgate/status`` shows them. Memory is bounded by the running rollouts: a rollout's figures are
dropped once it ends (``keep``). Errors are the answers a caller did not cause: 5xx, kvgate's own
upstream and availability errors; a 4xx (bad input, not found) is no fault of the version.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.model import Target
from gateway.core.split import ROLES


@dataclass
class VersionFigures:
    requests: int = 0
    errors: int = 0
    first_bytes: int = 0  # requests whose first byte came (the TTFB mean's count)
    first_byte_s: float = 0.0  # their total time to first byte

    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, float | int | None]:
        mean = self.first_byte_s / self.first_bytes if self.first_bytes else None
        return {"requests": self.requests, "errors": self.errors, "error_rate": self.error_rate(),
                "ttfb_mean_s": mean}  # fmt: skip


class RolloutStats:
    def __init__(self) -> None:
        self._figures: dict[tuple[str, str], dict[str, VersionFigures]] = {}
        """(logical ID, candidate digest) -> role -> figures."""

    def _of(self, target: Target) -> VersionFigures:
        key = (target.logical_id, target.rollout)
        roles = self._figures.setdefault(key, {role: VersionFigures() for role in ROLES})
        return roles[target.role]

    def first_byte(self, target: Target, seconds: float) -> None:
        """A request of a running rollout (``target.role`` set) got its first byte after SECONDS."""
        figures = self._of(target)
        figures.first_bytes += 1
        figures.first_byte_s += seconds

    def finished(self, target: Target, *, error: bool) -> None:
        figures = self._of(target)
        figures.requests += 1
        figures.errors += int(error)

    def figures(self, logical_id: str, candidate_digest: str) -> dict[str, VersionFigures]:
        return self._figures.get((logical_id, candidate_digest), {role: VersionFigures() for role in ROLES})

    def keep(self, running: dict[str, str]) -> None:
        """Forget every rollout not in RUNNING (logical ID -> candidate digest)."""
        for key in list(self._figures):
            if running.get(key[0]) != key[1]:
                del self._figures[key]
