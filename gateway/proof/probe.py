"""The audit's probe, sized for the server it audits: long enough to span several KV blocks with that
server's own tokenizer, short enough to fit its context.

A warm hit is only visible when the prompt spans more than one full KV block, so the probe must hold at
least two blocks and a token, plus the generated tokens, inside ``max_model_len``. The block size is not
in vLLM's API: ``BLOCK_TOKENS`` (128, the CPU build's default and the largest common one) is assumed, so
on GPUs (16-token blocks) the probe spans many more blocks. Token counts come from the server itself (a
one-token completion's ``usage.prompt_tokens`` in a throwaway namespace), so the tokenizer is always the
audited one. A context too small for two blocks is not a failure of the server: it is ``CannotAudit``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.core.errors import AuditError
from gateway.proof.experiment import long_prompt

BLOCK_TOKENS = 128
PROBE_BLOCKS = 3  # aim for three blocks and a half: a warm hit then covers at least two full blocks
SPECIAL_TOKENS = 8  # room kept for tokens a chat template or BOS adds
START_SENTENCES = 4  # about 60 tokens with an English tokenizer: fits any context worth auditing
MAX_SENTENCES = 400  # about 30,000 characters: a server that counts fewer tokens than that is not sized

TokenCounter = Callable[[str], Awaitable[int]]


class CannotAudit(AuditError):
    """The server's context cannot hold a probe that spans two KV blocks: no verdict can be drawn."""

    type = "cannot_audit"


@dataclass(frozen=True, slots=True)
class Probe:
    prompt: str
    prompt_tokens: int


def probe_budget(
    context: int | None, *, max_tokens: int, block_tokens: int = BLOCK_TOKENS
) -> tuple[int, int]:
    """(fewest, most) prompt tokens a probe may have on a server with ``context`` tokens (None: unknown)."""
    fewest = 2 * block_tokens + 1
    most = (context or 8 * block_tokens) - max_tokens - SPECIAL_TOKENS
    if most < fewest:
        raise CannotAudit(
            f"cannot audit: a {context}-token context cannot hold two {block_tokens}-token KV blocks "
            f"and {max_tokens} generated tokens"
        )
    return fewest, min(most, PROBE_BLOCKS * block_tokens + block_tokens // 2)


async def fit_probe(
    count: TokenCounter, context: int | None, *, max_tokens: int, block_tokens: int = BLOCK_TOKENS
) -> Probe:
    """The longest fixed-text prompt (whole sentences) within the budget, measured by ``count``."""
    fewest, goal = probe_budget(context, max_tokens=max_tokens, block_tokens=block_tokens)
    sentences = START_SENTENCES
    tokens = await count(long_prompt(sentences))
    for _ in range(3):  # scale by the measured tokens per sentence (near linear on this text)
        guess = min(max(int(goal * sentences / max(tokens, 1)), 1), MAX_SENTENCES)
        if guess == sentences:
            break
        sentences, tokens = guess, await count(long_prompt(guess))
    while tokens > goal and sentences > 1:
        sentences -= 1
        tokens = await count(long_prompt(sentences))
    if tokens < fewest:
        raise CannotAudit(f"cannot audit: the probe has {tokens} tokens, fewer than two KV blocks ({fewest})")
    return Probe(long_prompt(sentences), tokens)
