"""The audit's probe fits the audited server: its context and its own tokenizer."""

from __future__ import annotations

import pytest

from gateway.proof.experiment import PROBE_MAX_TOKENS, long_prompt
from gateway.proof.probe import BLOCK_TOKENS, MAX_SENTENCES, CannotAudit, fit_probe, probe_budget


@pytest.mark.parametrize("per_char", [0.25, 1.0, 2.0])  # an English BPE, a byte-level, a very fine tokenizer
async def test_the_probe_spans_two_blocks_and_fits_a_1024_token_context(per_char: float) -> None:
    calls: list[str] = []

    async def count(prompt: str) -> int:
        calls.append(prompt)
        return int(len(prompt) * per_char)

    probe = await fit_probe(count, 1024, max_tokens=PROBE_MAX_TOKENS)
    assert 2 * BLOCK_TOKENS < probe.prompt_tokens <= 1024 - PROBE_MAX_TOKENS
    assert probe.prompt_tokens == await count(probe.prompt), "the size is measured, not estimated"
    assert len(calls) <= 8, "a few measurements, not a search over every length"
    if per_char >= 1.0:
        assert await count(long_prompt()) > 1024, "the old fixed probe would not have fit this server"


async def test_a_context_without_room_for_two_blocks_cannot_be_audited() -> None:
    async def count(prompt: str) -> int:
        return len(prompt) // 4

    with pytest.raises(CannotAudit, match="cannot audit: a 200-token context"):
        await fit_probe(count, 200, max_tokens=PROBE_MAX_TOKENS)
    assert probe_budget(None, max_tokens=8)[0] == 2 * BLOCK_TOKENS + 1, "unknown context: the usual budget"


async def test_a_server_that_reports_no_prompt_tokens_cannot_be_audited() -> None:
    longest = 0

    async def count(prompt: str) -> int:
        nonlocal longest
        longest = max(longest, len(prompt))
        return 0  # no usage.prompt_tokens in its answers

    with pytest.raises(CannotAudit, match="fewer than two KV blocks"):
        await fit_probe(count, 4096, max_tokens=PROBE_MAX_TOKENS)
    assert longest <= len(long_prompt(MAX_SENTENCES)), "the search stays bounded"
