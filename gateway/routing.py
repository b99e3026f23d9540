"""Where a request goes: filter (healthy, base matches, version loaded) → score → pick.

Warm requests go only to replicas whose loaded version matches: a replica is eligible for a version
only when it lists the versioned name with that version's content-addressed root and serves the
base the version was published for. Among eligible replicas that are within their bounded load (no
replica takes more than ``LOAD_FACTOR`` times its fair share of in-flight requests), the one known to
hold the longest prefix of the prompt wins; ties go to a rendezvous hash of the first block key and the
replica, so a prefix that spilled onto several replicas keeps returning to the same one instead of
being spread by load (which would make every replica cache every tenant). With no match, the
least-loaded replica wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from blake3 import blake3

from gateway.epoch_table import VersionState
from gateway.prefix import PrefixIndex
from gateway.replicas import Replica

LOAD_FACTOR = 1.25


@dataclass(frozen=True, slots=True)
class Choice:
    replica: Replica
    decision: str  # "prefix" | "least-loaded" | "pinned" | "loaded"
    matched_blocks: int = 0


def same_base(replicas: Sequence[Replica], base: str, *, with_root: bool) -> list[Replica]:
    return [r for r in replicas if r.healthy and r.base_identity(with_root) == base]


def eligible(replicas: Sequence[Replica], version: VersionState, *, with_root: bool) -> list[Replica]:
    same = same_base(replicas, version.base, with_root=with_root)
    return [r for r in same if r.serves(version.name, version.path)]


def load_score(replica: Replica, busiest: int) -> float:
    """1.0 for an idle replica, falling towards 0 as it nears the busiest one's in-flight count."""
    return 1.0 - replica.in_flight / (busiest + 1)


def pick(candidates: Sequence[Replica]) -> Replica:
    """The least-loaded replica; ties go to the one with fewer adapters loaded, then list order."""
    busiest = max(r.in_flight for r in candidates)
    return max(candidates, key=lambda r: (load_score(r, busiest), -len(r.listing.adapters)))


def within_bound(candidates: Sequence[Replica], load_factor: float = LOAD_FACTOR) -> list[Replica]:
    """Replicas that can take one more request without exceeding their bounded share."""
    total = sum(r.in_flight for r in candidates) + 1
    capacity = max(1, math.ceil(load_factor * total / len(candidates)))
    return [r for r in candidates if r.in_flight + 1 <= capacity] or list(candidates)


def choose(candidates: Sequence[Replica], keys: list[bytes], index: PrefixIndex) -> Choice:
    allowed = within_bound(candidates)
    if keys:
        matched = {r.url: index.matched(keys, r.url) for r in allowed}
        best = max(allowed, key=lambda r: (matched[r.url], _rendezvous(keys[0], r)))
        if matched[best.url]:
            return Choice(best, "prefix", matched[best.url])
    return Choice(pick(allowed), "least-loaded")


def _rendezvous(key: bytes, replica: Replica) -> bytes:
    return blake3(key + replica.url.encode()).digest(8)
