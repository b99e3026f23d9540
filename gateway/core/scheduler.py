"""One decision per request: serve on replica R, or load the version on R and then serve. Pure, no I/O.

The decision runs over read-only replica views (``ReplicaView``; the fleet's ``Replica`` is one) in
named stages, so the next signal (KV events, adapter residency, lease counts) is one more function:

- filters: ``healthy`` → ``serves_base`` → ``pinned`` (admin audits) → ``holds_version``. A replica is
  eligible for a version only when it lists the versioned name with that version's content-addressed
  root, not quarantined there, not being unloaded there (``holds``), and serves the base the version was
  published for, by name and by fingerprint
  (``core.base_print``: a base swapped under the same name is another base): warm requests never meet
  another version.
- bound: ``within_bound`` drops replicas above ``LOAD_FACTOR`` times their fair share of in-flight
  requests (unless that would drop them all).
- scorers in [0, 1]: ``prefix_score`` (the share of the prompt's leading blocks a replica is known to
  hold: first precisely, by its KV events (``kv.index``), then as predicted by where kvgate sent
  prompts (``core.prefix``)) and ``load_score``; ties between prefix holders go to a rendezvous hash of
  the first block key and the replica, so a prefix that spilled onto several replicas keeps returning
  to one of them instead of being spread by load (which would make every replica cache every tenant).
- pick: the best prefix holder, else the least-loaded replica (fewer adapters loaded breaks ties, then
  the rendezvous hash of the first block key: independent kvgate processes agree on where a first
  sight goes, where list order sent them all to the first replica).

When no replica of the right base holds the version, the decision is "load on the least-loaded one
with room" (any, when none has room: the load waits for a slot there); when every holder is over its
bounded share and another replica of the base is within it and has room, it is "load there too"
(``spread_target``): a hot version spreads. Room is one idea (``has_room``: the adapter budget has a free
slot, or an adapter kvgate loaded there is idle and may be evicted), asked of the caller's budget through
``room``; ``evictions`` orders what a replica may unload to make it. The request path asks ``decide``
once per request (``request.placement``), again only on the retries it documents. The ``Scheduler``
owns the prefix index: it reads it to decide and records what a replica served, the one place that does
either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from blake3 import blake3

from gateway.core.base_print import prints_match
from gateway.core.errors import NoEligibleReplica
from gateway.core.model import Target
from gateway.core.prefix import PrefixIndex

LOAD_FACTOR = 1.25


class ReplicaView(Protocol):
    """What the scheduler may read of a replica (and nothing it could change)."""

    @property
    def url(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def adapter_count(self) -> int: ...
    @property
    def base(self) -> str | None:
        """The base model identity this replica serves (None until it answered a listing)."""
        ...

    @property
    def base_print(self) -> str | None:
        """Its base's fingerprint, encoded (None until taken since it last (re)started)."""
        ...

    @property
    def adapters(self) -> Mapping[str, str]:
        """What it lists: versioned name -> the root it loaded it from."""
        ...

    @property
    def quarantined(self) -> Mapping[str, str]:
        """Versioned name -> the root it is quarantined for there (``fleet.quarantine``)."""
        ...

    @property
    def unloading(self) -> Collection[str]:
        """Versioned names this kvgate is unloading there (draining them off it)."""
        ...

    def root_for(self, path: str) -> str:
        """Where it loads the version stored at ``path`` from (the store's path, or its agent's copy)."""
        ...


class HeldBlocks(Protocol):
    """What the scheduler reads of the precise index (``kv.index.PreciseIndex``): for a request's
    tokens, keyed in its cache namespace ``(adapter name, salt)``, how many leading blocks each replica
    (by URL) holds by its KV events."""

    def held_blocks(
        self, namespace: tuple[str | None, str | None], tokens: Sequence[int]
    ) -> Callable[[str], int]: ...


class TokenTrust(Protocol):
    """Whether a replica's KV events may route it (``kv.live_check.LiveCheck``): kvgate's token counts
    agree with its answers. A replica they do not is routed as if it had no events (predicted index)."""

    def exact(self, replica: str) -> bool: ...


R = TypeVar("R", bound=ReplicaView)
Action = Literal["serve", "load"]


@dataclass(slots=True)
class Decision(Generic[R]):
    replica: R
    action: Action
    reason: str  # serve: "prefix" | "least-loaded" | "pinned"; load: "loaded" | "spread"
    matched_blocks: int = 0
    prefix_source: str = "none"  # where matched_blocks comes from: "precise" (KV events) | "predicted"


# --- filters ---------------------------------------------------------------------------------------


def healthy(replicas: Sequence[R]) -> list[R]:
    return [r for r in replicas if r.healthy]


def serves_base(replicas: Sequence[R], base: str, base_print: str = "") -> list[R]:
    """Replicas of base identity ``base`` whose fingerprint matches ``base_print`` ('' : any)."""
    return [r for r in replicas if r.base == base and prints_match(base_print, r.base_print)]


def pinned(replicas: Sequence[R], pin: str | None) -> list[R]:
    return list(replicas) if pin is None else [r for r in replicas if r.url == pin]


def holds_version(replicas: Sequence[R], target: Target) -> list[R]:
    version = target.version
    if version is None:
        return list(replicas)
    return [r for r in replicas if holds(r, version.name, version.path)]


def holds(replica: ReplicaView, name: str, path: str) -> bool:
    """Whether ``replica`` serves version ``name`` (stored at ``path``): it lists the name with the
    content-addressed root it loads it from, that name is not quarantined there from that root, and this
    kvgate is not unloading it there (a version being drained off a replica takes no new request)."""
    root = replica.root_for(path)
    return (
        replica.adapters.get(name) == root
        and replica.quarantined.get(name) != root
        and (name not in replica.unloading)
    )


def capacity(replicas: Sequence[ReplicaView], load_factor: float = LOAD_FACTOR) -> int:
    """The bounded share: in-flight requests one replica may hold, counting the one being placed."""
    total = sum(r.in_flight for r in replicas) + 1
    return max(1, math.ceil(load_factor * total / len(replicas)))


def within_bound(candidates: Sequence[R], load_factor: float = LOAD_FACTOR) -> list[R]:
    """Replicas that can take one more request without exceeding their bounded share."""
    if len(candidates) < 2:  # alone, a replica is within its share whatever it holds
        return list(candidates)
    cap = capacity(candidates, load_factor)
    return [r for r in candidates if r.in_flight + 1 <= cap] or list(candidates)


def spread_target(
    of_base: Sequence[R], holders: Sequence[R], room: Callable[[R], bool], tie: bytes
) -> R | None:
    """Where a hot version should be loaded too: every holder is above its bounded share of the base's
    load, and a replica of the base that lacks the version is within it and has ``room``."""
    if len(of_base) == len(holders):  # every replica of the base holds it: nowhere to spread to
        return None
    cap = capacity(of_base)
    if any(r.in_flight + 1 <= cap for r in holders):
        return None
    roomy = [r for r in of_base if r not in holders and r.in_flight + 1 <= cap and room(r)]
    return least_loaded(roomy, tie) if roomy else None


def has_room(managed: Collection[str], pending: int, in_use: Mapping[str, int], budget: int) -> bool:
    """The one idea of room for one more adapter on a replica: fewer than ``budget`` adapters kvgate
    loaded there (``managed``) and loads under way (``pending``), or one of them with no request in
    flight here (``in_use``), which may be evicted (unless another kvgate leases it: then the load
    waits for a slot)."""
    if len(managed) + pending < budget:
        return True
    return any(not in_use.get(name) for name in managed)


def anywhere(replica: ReplicaView) -> bool:
    """``room`` when no budget is known: every replica has room."""
    return True


def eligible(replicas: Sequence[R], target: Target) -> list[R]:
    """Healthy replicas of the target's base that hold its version (every replica of the base for base
    requests): where a request may be served without a load."""
    return holds_version(serves_base(healthy(replicas), target.base, target.base_print), target)


# --- scorers (each in [0, 1]) ----------------------------------------------------------------------


def load_score(replica: ReplicaView, busiest: int) -> float:
    """1.0 for an idle replica, falling towards 0 as it nears the busiest one's in-flight count."""
    return 1.0 - replica.in_flight / (busiest + 1)


def prefix_score(matched_blocks: int, keys: Sequence[bytes]) -> float:
    """The share of the prompt's leading blocks the replica is known to hold."""
    return matched_blocks / len(keys) if keys else 0.0


# --- pick ------------------------------------------------------------------------------------------


def least_loaded(candidates: Sequence[R], tie: bytes) -> R:
    """The least-loaded replica; ties go to the one with fewer adapters loaded, then to the rendezvous
    hash of ``tie`` (the first block key, or the logical ID) and the replica: every kvgate process breaks
    a tie the same way for the same prompt, where list order sent every first sight to one replica."""
    if len(candidates) == 1:  # alone: nothing to weigh (the one-replica fleet's every request)
        return candidates[0]
    busiest = max(r.in_flight for r in candidates)
    return max(candidates, key=lambda r: (load_score(r, busiest), -r.adapter_count, _rendezvous(tie, r)))


def _rendezvous(key: bytes, replica: ReplicaView) -> bytes:
    return blake3(key + replica.url.encode()).digest(8)


def decide(
    replicas: Sequence[R],
    target: Target,
    *,
    pin: str | None = None,
    matched: Callable[[R], int],
    room: Callable[[R], bool] = anywhere,
    precise: Callable[[R], int] | None = None,
) -> Decision[R]:
    """Serve on an eligible replica, or load the target's version on one of its base: because no
    replica holds it ("loaded": on the least-loaded one with room, or the least-loaded one when none has
    room), or because every holder is over its bounded share ("spread": only where there is room).

    ``matched(r)`` tells how many leading blocks of ``target.keys`` replica ``r`` is predicted to hold;
    ``precise(r)``, when given, how many leading token blocks of the prompt its KV events say it holds:
    the longest precise match within the bound wins, then the predicted one, then load. ``room(r)``:
    whether a load on ``r`` could start now (the caller's adapter budget, by ``has_room``). Raises
    ``NoEligibleReplica`` when no healthy replica (the pinned one, if pinned) serves the base.
    """
    of_base = pinned(serves_base(healthy(replicas), target.base, target.base_print), pin)
    if not of_base:
        raise NoEligibleReplica(_nothing_serves(target, pin), param="model")
    holders = holds_version(of_base, target)
    if not holders:
        roomy = [r for r in of_base if room(r)]
        return Decision(least_loaded(roomy or of_base, target.logical_id.encode()), "load", "loaded")
    if pin is not None:
        return Decision(holders[0], "serve", "pinned", *_pinned_match(holders[0], matched, precise))
    first = target.keys[0] if target.keys else target.logical_id.encode()
    spread = spread_target(of_base, holders, room, target.logical_id.encode())
    if spread is not None:
        return Decision(spread, "load", "spread")
    allowed = within_bound(holders)
    if precise is not None:
        held = {r.url: precise(r) for r in allowed}
        best = _best(allowed, lambda r: held[r.url], first)
        if held[best.url]:
            return Decision(best, "serve", "prefix", held[best.url], "precise")
    if target.keys:
        scores = {r.url: matched(r) for r in allowed}
        best = _best(allowed, lambda r: prefix_score(scores[r.url], target.keys), first)
        if scores[best.url]:
            return Decision(best, "serve", "prefix", scores[best.url], "predicted")
    return Decision(least_loaded(allowed, first), "serve", "least-loaded")


def _best(allowed: Sequence[R], score: Callable[[R], float], first: bytes) -> R:
    """The best score; ties go to the rendezvous hash of the first block key (alone: no tie to break)."""
    if len(allowed) == 1:
        return allowed[0]
    return max(allowed, key=lambda r: (score(r), _rendezvous(first, r)))


def _pinned_match(
    replica: R, matched: Callable[[R], int], precise: Callable[[R], int] | None
) -> tuple[int, str]:
    held = precise(replica) if precise is not None else 0
    if held:
        return held, "precise"
    predicted = matched(replica)
    return predicted, "predicted" if predicted else "none"


def _nothing_serves(target: Target, pin: str | None) -> str:
    if pin is not None:
        return f"replica {pin} is unhealthy or does not serve base {target.base!r}{_print_of(target)}"
    if target.version is None:
        return f"no healthy replica serves base model {target.base!r}"
    return f"no healthy replica serves base {target.base!r}{_print_of(target)} for {target.logical_id!r}"


def _print_of(target: Target) -> str:
    return f" with fingerprint {target.base_print.partition(':')[0]}" if target.base_print else ""


def evictions(
    managed: Sequence[str], *, in_use: Mapping[str, int], current: set[str], last_used: Mapping[str, float]
) -> list[str]:
    """What a replica may unload to make room, best victim first: never a name in use; retired
    versions before current ones, then least recently used."""
    idle = [name for name in managed if not in_use.get(name)]
    return sorted(idle, key=lambda name: (name in current, last_used.get(name, 0.0)))


class Scheduler:
    """``decide`` over the prefix indexes this scheduler owns: the predicted one (``served`` records what
    kvgate sent where) and, when KV events are followed, the precise one (``precise``, fed by
    ``kv.follower``), for the replicas whose token counts agree (``trust``, ``kv.live_check``)."""

    def __init__(
        self, index_entries: int, *, precise: HeldBlocks | None = None, trust: TokenTrust | None = None
    ) -> None:
        self.index = PrefixIndex(index_entries)
        self.precise = precise
        self.trust = trust

    def decide(
        self,
        replicas: Sequence[R],
        target: Target,
        *,
        pin: str | None = None,
        room: Callable[[R], bool] = anywhere,
    ) -> Decision[R]:
        def matched(replica: R) -> int:
            return self.index.matched(target.keys, replica.url)

        held = self._precise_match(target)
        return decide(replicas, target, pin=pin, matched=matched, room=room, precise=held)

    def _precise_match(self, target: Target) -> Callable[[ReplicaView], int] | None:
        """How many leading token blocks of the request a replica holds by its events (None: no tokens,
        or no events followed). The request is keyed in the namespace its blocks will have there. A
        replica whose token counts disagree (``trust``) holds nothing by its events."""
        if self.precise is None or not target.tokens:
            return None
        name = target.version.name if target.version is not None else None
        held = self.precise.held_blocks((name, target.salt), target.tokens)
        trust = self.trust
        if trust is None:
            return lambda replica: held(replica.url)
        return lambda replica: held(replica.url) if trust.exact(replica.url) else 0

    def served(self, target: Target, replica: ReplicaView) -> None:
        if target.keys:
            self.index.record(target.keys, replica.url)
