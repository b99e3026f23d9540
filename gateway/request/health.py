"""``/healthz``: whether this kvgate can serve what it accepts, and the body that says why, in two views.

Ready (200) unless one of these holds (503), each named in ``unready`` in words that name no replica,
logical ID or key:

- it is draining (SIGTERM);
- no replica is healthy: no base is served, every request would be refused;
- a background task keeps failing (``failing``; ``tasks.supervisor.Supervisor``);
- with ``auth = "api-keys"``, its copy of the keys is older than ``auth_max_staleness``: every keyed
  request would get 503 ``KeysUnavailable``;
- with ``table_max_staleness`` set (off by default), its snapshot of the epoch table has not been
  confirmed current for longer. A stale table alone does not make kvgate unready otherwise: a lagging
  snapshot serves the previous version coherently, and a whole fleet going unready at once in a Redis
  outage would be an outage. The table's age and whether it is followed are always in the body.

Two views, built side by side (``Views``): ``public``, what an anonymous caller of the public listener
gets (readiness, counts, ages, the names of failing tasks), and ``detail``, the same fields with what
names replicas, logical IDs, API key ids or errors in place of their counts, on the admin listener or
with the admin token (as ``/metrics``). A new field goes into both with ``views.add(key, value)``, or
``views.add(key, count, detail=what_it_counts)`` when its details are not for everyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.tasks.supervisor import Supervisor

_SAME: Any = object()


class Views:
    """The public and the detail view of a ``/healthz`` body (or of one of its sections)."""

    def __init__(self) -> None:
        self.public: dict[str, Any] = {}
        self.detail: dict[str, Any] = {}

    def add(self, key: str, value: Any, *, detail: Any = _SAME) -> None:
        """``value`` in both views; with ``detail``, the detail view holds that instead (what names
        replicas, IDs, keys or errors; ``value`` is then only its count or summary)."""
        self.public[key] = value
        self.detail[key] = value if detail is _SAME else detail

    def section(self, key: str) -> Views:
        """A nested object under ``key`` in both views, to ``add`` to."""
        child = Views()
        self.public[key], self.detail[key] = child.public, child.detail
        return child


@dataclass
class Health:
    ready: bool
    public: dict[str, Any]
    detail: dict[str, Any]

    def view(self, detailed: bool) -> dict[str, Any]:
        return self.detail if detailed else self.public


def age(seconds: float) -> float | None:
    """An age for the body, rounded (None: never, e.g. nothing read yet)."""
    return round(seconds, 1) if math.isfinite(seconds) else None


def add_tasks(views: Views, supervisor: Supervisor) -> list[str]:
    """``background`` (each task's state; its last error in the detail view) and ``failing`` (the task
    names; with their reasons in the detail view); returns the failing task names."""
    tasks = supervisor.health()
    public = {name: {k: v for k, v in doc.items() if k != "last_error"} for name, doc in tasks.items()}
    views.add("background", public, detail=tasks)
    names = supervisor.failing_tasks()
    views.add("failing", names, detail=supervisor.failing())
    return names


def staleness_reason(what: str, seconds: float, setting: str, bound: float, then: str = "") -> str | None:
    """Why readiness fails when ``what`` is older than ``bound`` (None: it is not)."""
    if seconds <= bound:
        return None
    since = f"for {seconds:.0f} s" if math.isfinite(seconds) else "since the start"
    return f"{what} not readable {since} ({setting} {bound:g} s){then}"
