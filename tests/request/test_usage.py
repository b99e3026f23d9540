"""``relay.Usage``: the usage numbers of an answer, read from its bytes, counted once per answer."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN

from gateway.request.relay import Usage
from gateway.telemetry.metrics import Metrics


def chunk(prompt: int, cached: int, completion: int) -> bytes:
    usage = (
        f'"usage":{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
        f'"prompt_tokens_details":{{"cached_tokens":{cached}}}}}'
    )
    return b'data: {"choices":[],' + usage.encode() + b"}\n\n"


def test_a_stream_with_continuous_usage_counts_its_prompt_once() -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` repeats the usage in every chunk."""
    metrics = Metrics()
    usage = Usage(metrics, "tenant-1", INVALID_SPAN)
    for completion in (1, 2, 3):
        usage.scan(chunk(40, 32, completion))
    assert (usage.prompt, usage.cached) == (40, 32)
    labels = {"logical_id": "tenant-1"}
    samples = {
        name: metrics.registry.get_sample_value(name, labels)
        for name in ("kvgate_backend_prompt_tokens_total", "kvgate_backend_cached_tokens_total")
    }
    assert samples == {"kvgate_backend_prompt_tokens_total": 40, "kvgate_backend_cached_tokens_total": 32}
