"""The audit's verdicts: what one round observed per replica, and the judgement drawn from it.

See ``proof.audit`` for the experiment and what each verdict means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.proof.experiment import Sample

COHERENT = "coherent"
INCOHERENT = "incoherent-on-warm-hit"
MISMATCH = "replica-mismatch"
NONDETERMINISTIC = "nondeterministic"
CANNOT_AUDIT = "cannot-audit"
FAULTS = (INCOHERENT, MISMATCH, NONDETERMINISTIC)
TOLERANCE_MARGIN = 2.0  # tolerance = margin x the largest disagreement among cold runs


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one replica answered for one audit round."""

    replica: str
    served: str  # the name the replica served (versioned name through kvgate)
    digest: str | None  # adapter artifact digest, when known
    loaded_root: str | None  # what the replica's /v1/models lists for that name
    block_key: str | None  # the gateway's first prefix block key
    warm: tuple[Sample, ...]
    cold: tuple[Sample, ...]
    base_print: str | None = None  # the replica's base fingerprint, when kvgate reports it
    expected_base_print: str | None = None  # the one the version was published for
    base_mismatch: str | None = None  # why kvgate holds the replica to be another base (then no samples)


@dataclass(frozen=True, slots=True)
class Verdict:
    replica: str
    verdict: str
    detail: str
    tolerance: float
    cached_tokens: int
    observation: Observation = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["observation"] = asdict(self.observation)
        return doc


def judge(
    observations: Sequence[Observation],
    expected_digest: str | None = None,
    fingerprint: Sample | None = None,
    floor: float = 0.0,
) -> list[Verdict]:
    """Verdicts for one round. The reference is ``expected_digest``, else the most common digest;
    ``fingerprint`` is the version's cold answer recorded earlier (the canary's, from its first load);
    ``floor``: the smallest logprob tolerance (the rollout gate's, for audits under live traffic)."""
    sampled = [o for o in observations if o.base_mismatch is None]
    digests = [o.digest for o in sampled if o.digest]
    reference_digest = expected_digest or (Counter(digests).most_common(1)[0][0] if digests else None)
    reference = next((o for o in sampled if o.digest == reference_digest), sampled[0] if sampled else None)
    return [
        _other_base(o) if o.base_mismatch is not None or reference is None else
        _judge_one(o, reference, reference_digest, fingerprint, floor)
        for o in observations
    ]  # fmt: skip


def _other_base(obs: Observation) -> Verdict:
    detail = (
        f"another base under the version's base name: replica fingerprint {obs.base_print}, version "
        f"published for {obs.expected_base_print} ({obs.base_mismatch})"
    )
    return Verdict(obs.replica, MISMATCH, detail, 0.0, 0, obs)


def _judge_one(
    obs: Observation,
    reference: Observation,
    reference_digest: str | None,
    fingerprint: Sample | None,
    floor: float = 0.0,
) -> Verdict:
    first_cold = obs.cold[0]
    spread = max((first_cold.max_logprob_diff(other) for other in obs.cold[1:]), default=0.0)
    tolerance = max(spread * TOLERANCE_MARGIN, floor)
    hit = max((w.cached_tokens for w in obs.warm), default=0)

    def verdict(name: str, detail: str) -> Verdict:
        return Verdict(obs.replica, name, detail, tolerance, hit, obs)

    if any(c.text != first_cold.text for c in obs.cold[1:]):
        return verdict(NONDETERMINISTIC, "cold runs disagree with each other")
    if reference_digest and obs.digest and obs.digest != reference_digest:
        return verdict(MISMATCH, f"serves digest {obs.digest[:16]}, reference is {reference_digest[:16]}")
    if fingerprint is not None and not first_cold.agrees_with(fingerprint, tolerance):
        diff = first_cold.max_logprob_diff(fingerprint)
        return verdict(
            MISMATCH, f"cold answer differs from the version's fingerprint: max |dlogprob| {diff:.4f}"
        )
    if obs is not reference and not first_cold.agrees_with(reference.cold[0], tolerance):
        return verdict(MISMATCH, f"cold answer differs from reference replica {reference.replica}")
    for warm in obs.warm:
        if warm.cached_tokens and not warm.agrees_with(first_cold, tolerance):
            diff = warm.max_logprob_diff(first_cold)
            return verdict(
                INCOHERENT,
                f"warm hit ({warm.cached_tokens} cached tokens) differs from cold: max |dlogprob| {diff:.4f}",
            )
    detail = (
        f"warm == cold ({hit} cached tokens)" if hit else "warm == cold, but no warm request hit the cache"
    )
    return verdict(COHERENT, detail)


def cannot_audit(replica: str, reason: str) -> Verdict:
    nothing = Observation(replica, "", None, None, None, (), ())
    return Verdict(replica, CANNOT_AUDIT, reason, 0.0, 0, nothing)


def faulty(verdicts: Sequence[Verdict]) -> bool:
    """A fault was found (``cannot-audit`` is no verdict, not a fault)."""
    return any(v.verdict in FAULTS for v in verdicts)
