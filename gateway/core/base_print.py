"""A base model's fingerprint from its behaviour, and the rule that says two are the same base. Pure.

The fleet takes one per replica (``fleet.base_prints``): greedy tokens and token logprobs of a fixed
probe on the base model, each run in a fresh cache namespace (cold), a few runs. Published versions
carry the print of the base they were published for (``VersionState.base_print``), so a base swapped
under the same served name and path is another base: its print differs.

The rule (``BasePrint.matches``): the greedy tokens must be equal exactly (compared through a digest of
the generated text), and every token logprob within a tolerance. The tolerance is calibrated like the
audit's: ``TOLERANCE_MARGIN`` x the largest disagreement among the replica's own cold runs, never below
the configured floor (``base_print_tolerance``), and two prints compare within the larger of their two
tolerances. On the CPU build cold runs agree bit-exactly (spread 0), so the floor decides; it only has to
absorb batching noise, which is far below what other weights change.

Encoded as one string (what the epoch table stores and the cache namespace hashes):
``bp1-<16 hex of blake3(text)>:<tolerance>:<logprob>,<logprob>,...``; ``short`` is the part before the
first colon, for people.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from blake3 import blake3

SCHEME = "bp1"
PROBE_PROMPT = "The harbor master counted the boats that came in with the evening tide. A quiet engineer"
"""The fixed probe (a short prompt: a cold run needs no KV block to span)."""
PROBE_TOKENS = 8
PROBE_RUNS = 2  # cold runs per print: their spread calibrates the tolerance
TOLERANCE_MARGIN = 2.0  # as the audit: margin x the largest disagreement among cold runs
LOGPROB_DIGITS = 6


@dataclass(frozen=True, slots=True)
class BasePrint:
    tokens: str  # 16 hex of blake3 of the probe's greedy text: equal exactly, or another base
    logprobs: tuple[float, ...]
    tolerance: float

    @property
    def short(self) -> str:
        return f"{SCHEME}-{self.tokens}"

    def encode(self) -> str:
        logprobs = ",".join(f"{x:.{LOGPROB_DIGITS}f}" for x in self.logprobs)
        return f"{self.short}:{self.tolerance:.{LOGPROB_DIGITS}f}:{logprobs}"

    def difference(self, other: BasePrint) -> str | None:
        """Why ``other`` is another base (None: the same one, by the rule above)."""
        if self.tokens != other.tokens or len(self.logprobs) != len(other.logprobs):
            return f"greedy tokens differ ({self.short} vs {other.short})"
        diff = max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)
        tolerance = max(self.tolerance, other.tolerance)
        if diff > tolerance:
            return f"same greedy tokens, but max |dlogprob| {diff:.6f} > tolerance {tolerance:.6f}"
        return None

    def matches(self, other: BasePrint) -> bool:
        return self.difference(other) is None


def decode(text: str) -> BasePrint | None:
    """The print an encoded string holds; None for '' or anything not in the scheme."""
    head, _, rest = text.partition(":")
    scheme, _, tokens = head.partition("-")
    tolerance, _, logprobs = rest.partition(":")
    if scheme != SCHEME or len(tokens) != 16:
        return None
    try:
        values = tuple(float(x) for x in logprobs.split(",")) if logprobs else ()
        return BasePrint(tokens, values, float(tolerance))
    except ValueError:
        return None


def take(text: str, runs: Sequence[Sequence[float]], floor: float) -> BasePrint:
    """The print of a probe whose cold runs all gave ``text`` with these token logprobs (the first run's
    logprobs are kept; the spread between runs calibrates the tolerance)."""
    first = tuple(round(x, LOGPROB_DIGITS) for x in runs[0])
    spread = max((abs(a - b) for run in runs[1:] for a, b in zip(runs[0], run, strict=False)), default=0.0)
    tokens = blake3(text.encode()).hexdigest()[:16]
    return BasePrint(tokens, first, max(floor, TOLERANCE_MARGIN * spread))


def prints_match(expected: str, actual: str | None) -> bool:
    """Whether a replica whose print is ``actual`` (None: not taken yet) serves the base a version was
    published for (``expected``; '' for a version published without a print: then any print goes).
    Asked per request for every replica: a pure function of two strings, so its answers are cached."""
    if not expected:
        return True
    return _prints_match(expected, actual)


@functools.lru_cache(maxsize=4096)
def _prints_match(expected: str, actual: str | None) -> bool:
    want, have = decode(expected), decode(actual) if actual else None
    return want is not None and have is not None and want.matches(have)


def mismatch(expected: str, actual: str | None) -> str | None:
    """Why ``actual`` does not serve the base of ``expected`` (None: it does)."""
    if prints_match(expected, actual):
        return None
    want, have = decode(expected), decode(actual) if actual else None
    if have is None or want is None:
        return "the replica's base fingerprint is not taken yet"
    return want.difference(have)


def short(encoded: str | None) -> str | None:
    """The human part of an encoded print (``bp1-<16 hex>``)."""
    return encoded.partition(":")[0] if encoded else None
