"""The cold-versus-warm experiment's building blocks, shared by ``kvgate demo`` and the audit.

Same tokens, ``temperature=0``, token logprobs: a *warm* request reuses the prefix cache of its
namespace; a *cold* one runs in a fresh namespace (a random ``cache_salt``) so nothing is reused.
For one effective model, warm and cold must agree; on the CPU build they agree exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from gateway.core.errors import AuditError
from gateway.core.wire import EVIDENCE_HEADERS

_SENTENCES = (
    "The harbor master counted the boats that came in with the evening tide.",
    "A quiet engineer wrote down every number the old machine printed that night.",
    "Seven lanterns hung along the pier, and the wind moved each of them in turn.",
    "Nobody in the village remembered who had planted the row of tall pine trees.",
    "The market opened early, and the baker sold bread to the fishermen first.",
    "Rain fell on the library roof while the students read about distant rivers.",
)


PROBE_MAX_TOKENS = 8
"""Tokens generated per probe: enough to compare answers, few enough to keep audits cheap."""


def long_prompt(sentences: int = 15) -> str:
    """A fixed English prompt of whole sentences (15: 450 tokens with the test tokenizer); ``probe.py``
    picks the count that fits the audited server."""
    return " ".join(_SENTENCES[i % len(_SENTENCES)] for i in range(sentences))


@dataclass(frozen=True, slots=True)
class Sample:
    text: str
    token_logprobs: tuple[float, ...]
    cached_tokens: int
    prompt_tokens: int
    model: str
    evidence: dict[str, str] = field(default_factory=dict)

    def max_logprob_diff(self, other: Sample) -> float:
        if len(self.token_logprobs) != len(other.token_logprobs):
            return float("inf")
        pairs = zip(self.token_logprobs, other.token_logprobs, strict=True)
        return max((abs(a - b) for a, b in pairs), default=0.0)

    def agrees_with(self, other: Sample, tolerance: float = 0.0) -> bool:
        return self.text == other.text and self.max_logprob_diff(other) <= tolerance


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int = PROBE_MAX_TOKENS,
    cache_salt: str | None = None,
    headers: Mapping[str, str] | None = None,
    user: str | None = None,
) -> Sample:
    """One greedy completion with token logprobs; ``AuditError`` for an error or a malformed answer."""
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if user is not None:  # OpenAI's end-user field: a rollout's split key (core/split.py)
        body["user"] = user
    async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise AuditError(f"{base_url} answered {response.status}: {await response.text()}")
        try:
            doc = await response.json(content_type=None)
        except ValueError as exc:
            raise AuditError(f"{base_url} answered with a body that is not JSON: {exc}") from exc
        evidence = {name: response.headers[name] for name in EVIDENCE_HEADERS if name in response.headers}
    try:
        choice = doc["choices"][0]
        usage = doc.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Sample(
            text=choice["text"],
            token_logprobs=tuple(float(x) for x in choice["logprobs"]["token_logprobs"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            model=doc["model"],
            evidence=evidence,
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise AuditError(
            f"{base_url} answered a completion without text and token logprobs: {exc!r}"
        ) from exc
