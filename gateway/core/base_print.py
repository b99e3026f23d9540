"""A base model's identity: its bytes where kvgate can read them, else its behaviour, and the rule that says
two are the same base. Pure.

The fleet takes one per replica incarnation (``fleet.base_prints``); a published version carries the one of
the base it was published for (``VersionState.base_print``), so a base swapped under the same served name
and path is another base. A print holds either part or both:

- **bytes**: blake3 of the base's config, tokenizer and weight files (``fleet.base_bytes``), where kvgate
  can read the model directory. Exact, and blind to load: where both prints have bytes, **the bytes
  decide**. Equal bytes are one base whatever the behaviour says (the CPU build and GPUs are not
  bit-exact under concurrent load); other bytes are another base.
- **behaviour**: the first token's distribution after each of ``PROBE_PROMPTS`` (one request, cold,
  ``max_tokens`` 1, the top ``TOP_K`` logprobs): per prompt, the top-K logprob values in order and which
  token is first. Only the first position is read, so no earlier choice can send two runs down different
  continuations. (The probe text teacher-forced through prompt logprobs would be the cleaner signal, but
  vLLM 0.32's CPU build with ``--enable-lora`` kills its engine when prompt logprobs are batched with other
  requests: ``einsum(): subscript b has size 13 ... 75`` in ``add_lora_logits``, seen 2026-12-03.) It
  decides only where one of the two prints has no bytes.

The behaviour rule (``BasePrint.difference``), made so that batching noise cannot cross it:

- the **mean** |dlogprob| over every prompt's sorted top-K values must be within the tolerance. Sorted
  values are continuous in the logits: a near-tie that swaps two tokens leaves them where they were,
  while other weights move all of them;
- a prompt's first token may differ only where it is a near-tie: where both prints' top-1 margin (top-1
  minus top-2 logprob) exceeds ``MARGIN_FACTOR`` x the tolerance, a different first token is a difference.

The tolerance is ``TOLERANCE_MARGIN`` x the mean disagreement among the replica's own cold runs, never
below the configured floor (``base_print_tolerance``, 0.05 by default); two prints compare within the
larger of their two tolerances. A difference is acted on only once repeated prints confirm it
(``fleet.base_prints``, ``CONFIRM_PROBES``): one probe is never enough.

Encoded as one string (what the epoch table stores and the cache namespace hashes):
``bp2-<16 hex id>:<bytes digest or ''>:<tolerance>:<first tokens, 8 hex each>:<logprob>,<logprob>,...``,
where the id is the bytes digest's head, else a digest of the first tokens; ``short`` is the part before
the first colon, for people (where the behaviour decides, two prints of one base can show two ids: the
rule, not the id, says whether they are one base). Prints of the first scheme (``bp1-``: greedy text, from
tables written before) still decode, as ``legacy``: their behaviour cannot be compared with today's probe,
so a version that carries one is held to the base's reference print, like a version published without
one (``ReplicaPool.expected_print``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from blake3 import blake3

SCHEME = "bp2"
LEGACY_SCHEME = "bp1"  # greedy text of an 8-token probe (before 2026-12-03): decoded, never compared
PROBE_PROMPTS = (
    "The harbor master counted the boats that came in with the evening tide.",
    "A quiet engineer wrote each name in a ledger",
    "The gulls argued over the nets until",
    "Seven lamps were lit along the",
    "Rain fell on the",
    "She opened the old wooden",
    "In the morning the market",
    "Numbers: 3, 14, 15,",
)
"""The fixed probe prompts, sent as one request: the first token's distribution after each is read."""
TOP_K = 5  # top logprobs read per prompt
TOP_SPARE = 3
"""Asked for beyond ``TOP_K``: the answer keys top logprobs by token text, and two token ids that decode
to one text (byte pieces) leave one entry (seen on vLLM 0.32: 4 of 5)."""
PROBE_RUNS = 2  # cold runs per print: their spread calibrates the tolerance
CONFIRM_PROBES = 3  # prints taken before a replica is held to differ from what it was expected to be
TOLERANCE_MARGIN = 2.0  # as the audit: margin x the disagreement among cold runs
MARGIN_FACTOR = 2.0  # a first token differs only where both top-1 margins exceed this x the tolerance
LOGPROB_DIGITS = 4

Run = Sequence[Sequence[tuple[str, float]]]
"""One cold run of the probe: per prompt, its top ``TOP_K`` (token, logprob), highest first."""


@dataclass(frozen=True, slots=True)
class BasePrint:
    bytes: str  # blake3 of the base's files (64 hex); '' where they could not be read
    tops: tuple[str, ...]  # per prompt, 8 hex of blake3 of its first token; () : no behaviour taken
    logprobs: tuple[float, ...]  # per prompt, its top-K logprob values, highest first (flattened)
    tolerance: float
    legacy: bool = False  # a ``bp1`` print: its behaviour is of another probe (``tops`` holds its id)

    @property
    def short(self) -> str:
        if self.legacy:
            return f"{LEGACY_SCHEME}-{self.tops[0]}"
        ident = blake3(",".join(self.tops).encode()).hexdigest()[:16] if self.tops else ""
        return f"{SCHEME}-{self.bytes[:16] or ident}"

    @property
    def behaviour(self) -> bool:
        return bool(self.tops) and not self.legacy

    def encode(self) -> str:
        logprobs = ",".join(f"{x:.{LOGPROB_DIGITS}f}" for x in self.logprobs)
        tops = ",".join(self.tops)
        return f"{self.short}:{self.bytes}:{self.tolerance:.{LOGPROB_DIGITS}f}:{tops}:{logprobs}"

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
        if len(self.tops) != len(other.tops) or len(self.logprobs) != len(other.logprobs):
            return "the probe's answers differ in shape (another probe or server)"
        tolerance = max(self.tolerance, other.tolerance)
        mean = mean_difference(self.logprobs, other.logprobs)
        if mean > tolerance:
            return f"top logprobs differ: mean |dlogprob| {mean:.4f} > tolerance {tolerance:.4f}"
        bound, k = MARGIN_FACTOR * tolerance, len(self.logprobs) // len(self.tops)
        for i, (ours, theirs) in enumerate(zip(self.tops, other.tops, strict=True)):
            margin = min(_margin(self.logprobs, i, k), _margin(other.logprobs, i, k))
            if ours != theirs and margin > bound:
                return (f"the first token after probe prompt {i} differs, though neither is a near-tie "
                        f"(top-1 margins over {margin:.4f} > {bound:.4f})")  # fmt: skip
        return None

    def matches(self, other: BasePrint) -> bool:
        return self.comparable(other) and self.difference(other) is None


def _margin(values: Sequence[float], prompt: int, k: int) -> float:
    """Top-1 minus top-2 logprob of one prompt (how far from a tie its first token is)."""
    return values[prompt * k] - values[prompt * k + 1] if k > 1 else math.inf


def mean_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a) if a else 0.0


def decode(text: str) -> BasePrint | None:
    """The print an encoded string holds; None for '' or anything not in either scheme."""
    head, _, rest = text.partition(":")
    scheme, _, ident = head.partition("-")
    try:
        if scheme == LEGACY_SCHEME and len(ident) == 16:
            tolerance, _, logprobs = rest.partition(":")
            return BasePrint("", (ident,), _floats(logprobs), float(tolerance), legacy=True)
        fields = rest.split(":")
        if scheme != SCHEME or len(fields) != 4:
            return None
        tops = tuple(fields[2].split(",")) if fields[2] else ()
        found = BasePrint(fields[0], tops, _floats(fields[3]), float(fields[1]))
    except ValueError:
        return None
    shaped = not tops or (len(found.logprobs) >= 2 * len(tops) and len(found.logprobs) % len(tops) == 0)
    return found if found.short == head and (found.bytes or tops) and shaped else None


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",")) if text else ()


def take(runs: Sequence[Run], floor: float, bytes_: str = "") -> BasePrint:
    """The print of a probe whose cold runs gave these tops (the first run's are kept; the mean
    disagreement between runs' values calibrates the tolerance)."""
    values = [[x for top in run for _, x in top] for run in runs]
    first = tuple(round(x, LOGPROB_DIGITS) for x in values[0])
    spread = max((mean_difference(values[0], v) for v in values[1:] if len(v) == len(values[0])), default=0.0)
    tops = tuple(blake3(top[0][0].encode()).hexdigest()[:8] for top in runs[0])
    return BasePrint(bytes_, tops, first, max(floor, TOLERANCE_MARGIN * spread))


def of_bytes(bytes_: str) -> BasePrint:
    """A print of the bytes alone (the behaviour not taken yet)."""
    return BasePrint(bytes_, (), (), 0.0)


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
