"""Where a request goes: filter (healthy, base matches, version loaded) → score (load) → pick.

Warm requests go only to replicas whose loaded version matches: a replica is eligible for a version
only when it lists the versioned name with that version's content-addressed root and serves the
base the version was published for. Every stage is a plain function over ``Replica`` objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.epoch_table import VersionState
from gateway.replicas import Replica


def same_base(replicas: Sequence[Replica], base: str, *, with_root: bool) -> list[Replica]:
    return [r for r in replicas if r.healthy and r.base_identity(with_root) == base]


def eligible(replicas: Sequence[Replica], version: VersionState, *, with_root: bool) -> list[Replica]:
    return [
        r
        for r in same_base(replicas, version.base, with_root=with_root)
        if r.serves(version.name, version.path)
    ]


def load_score(replica: Replica, busiest: int) -> float:
    """1.0 for an idle replica, falling towards 0 as it nears the busiest one's in-flight count."""
    return 1.0 - replica.in_flight / (busiest + 1)


def pick(candidates: Sequence[Replica]) -> Replica:
    """The best-scoring replica; ties go to the one with fewer adapters loaded, then list order."""
    busiest = max(r.in_flight for r in candidates)
    return max(candidates, key=lambda r: (load_score(r, busiest), -len(r.listing.adapters)))
