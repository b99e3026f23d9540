"""The parse stage: ``stream`` read the way vLLM reads it, heavy bodies forwarded intact, and prefix keys
computed from a bounded rendering of the prompt."""

from __future__ import annotations

import asyncio
import io
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.core.prefix import BLOCK_CHARS, MAX_BLOCKS, block_keys, content_keys, prompt_text
from tests.support.adapter_files import MakeAdapter
from tests.support.edge import assert_openai_error, kvgate
from tests.support.serve_modes import serve_shape  # noqa: F401  (autouse: every test here runs in both shapes)
from tests.support.stub_backend import StubState

PREFIX_CHARS = MAX_BLOCKS * BLOCK_CHARS


# Each test sends every value to one kvgate (in each shape): the values are independent requests, and a
# kvgate per value (a `kvgate serve --workers 2` each, in that shape) cost seconds apiece.
STREAMS = ["true", "True", "1", 1, "yes", "on"]
NOT_STREAMS = ["false", "0", 0, "no", None, False]
REFUSED = ["maybe", 2, [], {}, " true", 0.5]


async def test_stream_given_as_a_string_or_number_streams_as_vllm_reads_it(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """vLLM's request model reads ``stream`` as a lax boolean: ``"true"`` streams, so kvgate must relay a
    stream, chunk by chunk. The stub holds each stream after the first chunk: a relay that buffers the
    whole answer never shows that chunk."""
    stub = StubState()
    async with kvgate(redis, tmp_path, make_adapter, stub) as edge, aiohttp.ClientSession() as http:
        for stream in STREAMS:
            stub.hold = hold = asyncio.Event()
            body = {"model": "tenant-42", "prompt": "x", "stream": stream}
            async with http.post(edge.url + "/v1/completions", json=body) as r:
                assert (r.status, r.content_type) == (200, "text/event-stream"), stream
                try:
                    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), timeout=10)
                finally:
                    hold.set()  # whatever happened, let the stub finish its stream
                rest = await r.read()
            assert first.startswith(b'data: {"id"'), stream
            assert b'"model":"tenant-42"' in first, stream
            assert rest.rstrip().endswith(b"data: [DONE]"), stream


async def test_stream_read_as_false_answers_one_json_body(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        for stream in NOT_STREAMS:
            body = {"model": "tenant-42", "prompt": "x", "stream": stream}
            async with http.post(edge.url + "/v1/completions", json=body) as r:
                assert (r.status, r.content_type) == (200, "application/json"), stream
                assert (await r.json())["model"] == "tenant-42", stream


async def test_stream_vllm_would_refuse_is_a_400_naming_the_field(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        for stream in REFUSED:
            body = {"model": "tenant-42", "prompt": "x", "stream": stream}
            async with http.post(edge.url + "/v1/completions", json=body) as r:
                error = assert_openai_error(r.content_type, await r.read(), r.status)
            assert (r.status, error["param"]) == (400, "stream"), stream
        assert edge.stub.received == []


def token_prompt(size: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(size)]


async def test_a_4mb_token_id_prompt_is_forwarded_intact_with_the_gateways_namespace(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    tokens = token_prompt(560_000)
    body = {"model": "tenant-42", "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
            "logit_bias": {"50256": -100}, "cache_salt": "client-chosen", "user": "é ü 😀"}  # fmt: skip
    raw = json.dumps(body).encode()
    assert 3_900_000 < len(raw) <= 4 * 1024 * 1024
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        headers = {"Content-Type": "application/json"}
        payload = io.BytesIO(raw)  # aiohttp warns about sending over 1 MiB of bytes at once
        async with http.post(edge.url + "/v1/completions", data=payload, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["model"] == "tenant-42"
            prefix_key = response.headers["x-kvgate-prefix-key"]
    sent = edge.stub.received[-1]
    assert sent["model"] == edge.versioned
    assert sent["cache_salt"].startswith("kvg-")
    assert sent["cache_salt"] != "client-chosen"
    assert sent["prompt"] == tokens
    assert {k: v for k, v in sent.items() if k not in {"model", "cache_salt"}} == {
        k: v for k, v in body.items() if k not in {"model", "cache_salt"}
    }
    full = json.dumps(tokens, separators=(",", ":"))
    assert prefix_key == block_keys(sent["cache_salt"], content_keys(full))[0].hex()


def canonical(value: Any) -> str:
    """The whole prompt rendered the way prefix keys see it (what ``prompt_text`` must begin with)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


PROMPTS: dict[str, Any] = {
    "short string": "hello",
    "long string": 'ab"\\ç😀\n' * 100_000,
    "token ids": token_prompt(400_000),
    "short token ids": [1, 2, 3],
    "batch of token ids": [token_prompt(50_000, seed) for seed in range(4)],
    "one huge row": [token_prompt(300_000)],
    "batch of strings": ['é"x' * 30_000, "y" * 10],
    "floats and literals": [1.5, -0.0, 1e300, True, None, False, "s"] * 20_000,
    "nested": [[[[[1, [2, ["deep"]]]]]]] * 5_000,
    "deep": json.loads("[" * 900 + "]" * 900),
}
MESSAGES: dict[str, Any] = {
    "short chat": [{"role": "user", "content": "hi"}],
    "long chat": [{"role": "system", "content": "s" * 1000}, {"role": "user", "content": "ü\n" * 200_000}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "t" * 100_000}, {"z": 1, "a": [2]}]}],
    "many turns": [{"role": "user", "content": f"turn {i}", "name": "n"} for i in range(50_000)],
}


@pytest.mark.parametrize("name", sorted(PROMPTS) + sorted(MESSAGES))
def test_prompt_text_is_the_bounded_prefix_of_the_whole_rendering(name: str) -> None:
    """Only the first MAX_BLOCKS blocks are ever keyed, so only that much of the prompt is rendered; the
    keys are those of the whole text's leading blocks."""
    body = {"messages": MESSAGES[name]} if name in MESSAGES else {"prompt": PROMPTS[name]}
    text = prompt_text(body)
    assert len(text) <= PREFIX_CHARS
    if name == "deep":  # deeper than json.dumps can go: the rendering is iterative
        assert text == "[" * 900 + "]" * 900
        return
    full = canonical(body.get("messages", body.get("prompt")))
    assert text == full[:PREFIX_CHARS]
    assert block_keys("seed", content_keys(text)) == block_keys("seed", content_keys(full))


def test_prompt_text_of_odd_bodies() -> None:
    assert prompt_text({}) == ""
    assert prompt_text({"prompt": 42}) == "42"
    assert prompt_text({"prompt": {"b": 1, "a": [True]}}) == '{"a":[true],"b":1}'
    assert prompt_text({"messages": "not a list", "prompt": "ignored"}) == '"not a list"'
