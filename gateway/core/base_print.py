"""A base model's identity: its bytes where kvgate can read them, else its behaviour, and the rule that says
two are the same base. Pure.

The fleet takes one per replica incarnation (``fleet.base_prints``); a published version carries the one of
the base it was published for (``VersionState.base_print``), so a base swapped under the same served name
and path is another base. A print holds either part or both:

- **bytes**: blake3 of the base's config, tokenizer and weight files (``fleet.base_bytes``), where kvgate
  can read the model directory. Exact, and blind to load: where both prints have bytes, **the bytes
  decide**. Equal bytes are one base whatever the behaviour says (the CPU build and GPUs are not
  bit-exact under concurrent load); other bytes are another base.
- **behaviour**: the fixed probe text *teacher-forced* (sent as the prompt with ``echo`` and
  ``logprobs``, cold): the server's logprob of each of its tokens given the ones before. Nothing is
  chosen greedily, so a near-tie between two tokens cannot flip what the print is made of: batching
  noise moves each logprob by a rounding step, other weights move all of them. It decides only where one
  of the two prints has no bytes.

The behaviour rule (``BasePrint.difference``): the probe must tokenize the same (``tokens``, a digest of
the token strings: another tokenizer is another base), and the **mean** |dlogprob| over the probe's
tokens must be within the tolerance. The mean, not the largest: one token's rounding cannot carry it,
while other weights shift every token. The tolerance is ``TOLERANCE_MARGIN`` x the mean disagreement
among the replica's own cold runs, never below the configured floor (``base_print_tolerance``, 0.05 by
default: batching noise on the CPU build stays below a tenth of it, other weights of the same shape are
tens of times above it); two prints compare within the larger of their two tolerances. A difference is
acted on only once repeated probes confirm it (``fleet.base_prints``): one probe is never enough.

Encoded as one string (what the epoch table stores and the cache namespace hashes):
``bp2-<16 hex id>:<bytes digest or ''>:<tolerance>:<tokens or ''>:<logprob>,<logprob>,...``, where the id
is the bytes digest's head, else the tokens; ``short`` is the part before the first colon, for people.
Prints of the first scheme (``bp1-``: greedy text, from tables written before) still decode, as
``legacy``: their behaviour cannot be compared with today's probe, so a version that carries one is held
to the base's reference print, like a version published without one (``ReplicaPool.expected_print``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from blake3 import blake3

SCHEME = "bp2"
LEGACY_SCHEME = "bp1"  # greedy text of an 8-token probe (before 2026-12-03): decoded, never compared
PROBE_PROMPT = (
    "The harbor master counted the boats that came in with the evening tide. A quiet engineer wrote "
    "each name in a ledger, and the gulls argued over the nets until the lamps were lit."
)
"""The fixed probe text, teacher-forced: its own tokens are what is scored (one token is generated, and
not used)."""
PROBE_RUNS = 2  # cold runs per print: their spread calibrates the tolerance
CONFIRM_PROBES = 3  # prints taken before a replica is held to differ from what it was expected to be
TOLERANCE_MARGIN = 2.0  # as the audit: margin x the disagreement among cold runs
LOGPROB_DIGITS = 4


@dataclass(frozen=True, slots=True)
class BasePrint:
    bytes: str  # blake3 of the base's files (64 hex); '' where they could not be read
    tokens: str  # 16 hex of blake3 of the probe's token strings; '' : no behaviour taken
    logprobs: tuple[float, ...]  # the probe's teacher-forced token logprobs
    tolerance: float
    legacy: bool = False  # a ``bp1`` print: its behaviour is of another probe

    @property
    def short(self) -> str:
        scheme = LEGACY_SCHEME if self.legacy else SCHEME
        return f"{scheme}-{self.bytes[:16] or self.tokens}"

    @property
    def behaviour(self) -> bool:
        return bool(self.tokens) and not self.legacy

    def encode(self) -> str:
        logprobs = ",".join(f"{x:.{LOGPROB_DIGITS}f}" for x in self.logprobs)
        return f"{self.short}:{self.bytes}:{self.tolerance:.{LOGPROB_DIGITS}f}:{self.tokens}:{logprobs}"

    def comparable(self, other: BasePrint) -> bool:
        """Whether the rule can tell: both have bytes, or both a behaviour of today's probe."""
        return bool(self.bytes and other.bytes) or (self.behaviour and other.behaviour)

    def difference(self, other: BasePrint) -> str | None:
        """Why ``other`` is another base (None: the same one, or it cannot be told: ``comparable``)."""
        if self.bytes and other.bytes:
            if self.bytes != other.bytes:
                return f"base bytes differ ({self.bytes[:16]} vs {other.bytes[:16]})"
            return None
        return self.behaviour_difference(other)

    def behaviour_difference(self, other: BasePrint) -> str | None:
        """Why the behaviour of ``other`` is another base's (None: the same, or either has none)."""
        if not (self.behaviour and other.behaviour):
            return None
        if self.tokens != other.tokens or len(self.logprobs) != len(other.logprobs):
            return f"the probe tokenizes differently ({self.tokens} vs {other.tokens})"
        mean = mean_difference(self.logprobs, other.logprobs)
        tolerance = max(self.tolerance, other.tolerance)
        if mean > tolerance:
            return f"teacher-forced logprobs differ: mean |dlogprob| {mean:.4f} > tolerance {tolerance:.4f}"
        return None

    def matches(self, other: BasePrint) -> bool:
        return self.comparable(other) and self.difference(other) is None


def mean_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a) if a else 0.0


def decode(text: str) -> BasePrint | None:
    """The print an encoded string holds; None for '' or anything not in either scheme."""
    head, _, rest = text.partition(":")
    scheme, _, ident = head.partition("-")
    try:
        if scheme == LEGACY_SCHEME and len(ident) == 16:
            tolerance, _, logprobs = rest.partition(":")
            return BasePrint("", ident, _floats(logprobs), float(tolerance), legacy=True)
        fields = rest.split(":")
        if scheme != SCHEME or len(fields) != 4:
            return None
        found = BasePrint(fields[0], fields[2], _floats(fields[3]), float(fields[1]))
    except ValueError:
        return None
    return found if found.short == head and (found.bytes or found.logprobs) else None


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",")) if text else ()


def take(tokens: str, runs: Sequence[Sequence[float]], floor: float, bytes_: str = "") -> BasePrint:
    """The print of a probe that tokenized as ``tokens`` and whose cold runs gave these teacher-forced
    logprobs (the first run's are kept; the mean disagreement between runs calibrates the tolerance)."""
    first = tuple(round(x, LOGPROB_DIGITS) for x in runs[0])
    spread = max((mean_difference(runs[0], run) for run in runs[1:] if len(run) == len(runs[0])), default=0.0)
    digest = blake3(tokens.encode()).hexdigest()[:16]
    return BasePrint(bytes_, digest, first, max(floor, TOLERANCE_MARGIN * spread))


def of_bytes(bytes_: str) -> BasePrint:
    """A print of the bytes alone (the behaviour not taken yet)."""
    return BasePrint(bytes_, "", (), 0.0)


def with_bytes(taken: BasePrint | None, bytes_: str | None) -> BasePrint | None:
    """``taken`` (the behaviour, or None) with the bytes read for the same incarnation (None: unread)."""
    if taken is None:
        return of_bytes(bytes_) if bytes_ else None
    return dataclasses.replace(taken, bytes=bytes_ or "")


def current(encoded: str) -> bool:
    """Whether an encoded print is of today's scheme (a ``bp1`` print is held to the base's reference)."""
    return encoded.startswith(f"{SCHEME}-")


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
    if have is None or want is None or not want.comparable(have):
        return "the replica's base fingerprint is not taken yet (or shares no part with the version's)"
    return want.difference(have)


def differs(expected: str, actual: str | None) -> str | None:
    """Why ``actual`` is known to be another base than ``expected`` (None: the same, or not known yet)."""
    want, have = decode(expected) if expected else None, decode(actual) if actual else None
    if want is None or have is None or not want.comparable(have):
        return None
    return want.difference(have)


def short(encoded: str | None) -> str | None:
    """The human part of an encoded print (``bp2-<16 hex>``)."""
    return encoded.partition(":")[0] if encoded else None
