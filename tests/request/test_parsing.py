"""Large bodies parsed in the parsing process (``gateway/request/parsing.py``): what comes back is bounded
by what routing uses (the leading blocks: the same keys and tokens as a short body with the same start),
the body still goes upstream whole and unchanged, and a body being parsed holds no other request."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.core import body as body_module
from gateway.core.body import Body, decode, forwarded
from gateway.core.prefix import BLOCK_CHARS, PREFIX_CHARS, block_keys, prompt_text
from gateway.kv.prompt_tokens import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MAX_CHARS,
    MAX_TOKENS,
    PromptTokens,
    of_route,
)
from gateway.request import parsing
from gateway.request.parsing import BodyParser
from gateway.telemetry.metrics import Metrics
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.edge import kvgate
from tests.support.tiny_tokenizer import write_tiny_model

SIZE = 4 * 1024 * 1024 - 1024
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog")


def big(shape: str, size: int, seed: int = 1) -> dict[str, Any]:
    """A request of ``shape`` whose JSON is about ``size`` bytes (same seed: the same start)."""
    rng = random.Random(seed)
    if shape == "token ids":
        return {"model": "tenant-42", "prompt": [rng.randrange(300) for _ in range(size // 4)]}
    if shape == "completion":
        return {"model": "tenant-42", "prompt": " ".join(rng.choice(WORDS) for _ in range(size // 6))}
    turns = [
        {"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choice(WORDS) for _ in range(20))}
        for i in range(size // 150)
    ]
    return {"model": "tenant-42", "messages": turns, "user": "u-1", "tools_note": "x"}


SHAPES = ("completion", "chat", "token ids")


@pytest.fixture
def tokens(tmp_path: Path) -> PromptTokens:
    return PromptTokens.from_path(write_tiny_model(tmp_path / "model"))


def route_of(shape: str) -> str:
    return CHAT_COMPLETIONS if shape == "chat" else COMPLETIONS


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_4mb_body_is_keyed_by_its_leading_blocks_only_as_a_short_body_with_the_same_start(
    shape: str, tokens: PromptTokens
) -> None:
    """The parsing process hands back a bounded body: its prefix keys and tokens are those of a short body
    that begins the same way (just past what keys reach), and it forwards the same bytes as the whole."""
    whole_doc = big(shape, SIZE)
    raw = orjson.dumps(whole_doc)
    assert 3_400_000 < len(raw) <= 4 * 1024 * 1024
    short_doc = big(shape, 3 * PREFIX_CHARS)
    parser = BodyParser(tokens)
    try:
        body, big_tokens = await parser.parse(raw, route_of(shape), model_optional=False, owned=frozenset())
    finally:
        parser.close()
    assert body.raw is raw
    assert len(pickle.dumps((body.doc, body.head, big_tokens))) < 4 * PREFIX_CHARS  # what crossed back
    short = decode(orjson.dumps(short_doc))
    assert body.head == prompt_text(short.doc) == prompt_text(whole_doc)
    assert block_keys("seed", body.head) == block_keys("seed", prompt_text(short.doc))
    assert len(block_keys("seed", body.head)) == PREFIX_CHARS // BLOCK_CHARS
    short_tokens = of_route(tokens, route_of(shape), short.doc)
    assert isinstance(big_tokens, tuple)
    assert big_tokens == short_tokens
    assert len(big_tokens) <= MAX_TOKENS
    owned = {"model": "tenant-42@0123456789abcdef", "cache_salt": "kvg-00"}
    assert forwarded(body, owned) == forwarded(decode(raw), owned)
    assert orjson.loads(forwarded(body, owned)) == {**whole_doc, **owned}


def test_token_ids_and_chat_are_walked_only_as_far_as_keys_reach(tokens: PromptTokens) -> None:
    """Past ``MAX_TOKENS`` ids a prompt is not read (a string there changes nothing); a chat template is
    rendered only until it passes ``MAX_CHARS`` (a message that fails the template further on is not
    reached), and both give the tokens of the whole request's start."""
    ids = list(range(1, 200)) * (MAX_TOKENS // 100)
    assert tokens.completion({"prompt": ids}) == tokens.completion({"prompt": [*ids, "not an id"]})
    assert len(tokens.completion({"prompt": ids})) == MAX_TOKENS  # type: ignore[arg-type]
    template = tokens.template
    assert template is not None
    messages = [{"role": "user", "content": "the lazy dog " * 50}] * (MAX_CHARS // 100)
    rendered = template.render(MAX_CHARS, messages=messages, bos_token="<|bos|>", add_generation_prompt=True)
    whole = template.render(messages=messages, bos_token="<|bos|>", add_generation_prompt=True)
    assert MAX_CHARS < len(rendered) < len(whole)
    assert whole.startswith(rendered)
    poisoned = [*messages, {"role": "user", "content": None, "bad": float("nan")}]
    assert tokens.chat({"messages": poisoned}) == tokens.chat({"messages": messages})


def test_a_body_kvgate_must_serialize_again_is_serialized_where_it_is_parsed() -> None:
    """A client's cache namespace field: the body goes up serialized without it (``rest``, computed in
    ``decode``), never with the client's; a body whose ``model`` can be replaced in place is not
    serialized at all."""
    doc = {"model": "m", "prompt": [1, 2, 3] * 1000, "cache_salt": "client"}
    body = decode(orjson.dumps(doc))
    assert body.splice is None
    assert body.rest is not None
    assert orjson.loads(forwarded(body, {"model": "v", "cache_salt": "kvg-1"})) == {
        **doc,
        "model": "v",
        "cache_salt": "kvg-1",
    }
    plain = decode(b'{"model": "m", "prompt": "hi"}')
    assert plain.rest is None
    assert plain.splice is not None
    assert forwarded(plain, {"model": "v"}) == b'{"model": "v", "prompt": "hi"}'


def held_parse(raw: bytes, path: str, model_optional: bool, owned: frozenset[str]) -> tuple[Body, Any]:
    """The parsing process's ``parse``, held until the test lets it go: it says it started (its pid in
    ``<gate>.started``), then waits (bounded) for the file ``<gate>``, named in the body."""
    gate = Path(orjson.loads(raw)["x_gate"])
    gate.with_suffix(".started").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60
    while not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the parsing process polls a file: the test's own waits are conditions
    return parsing.parse(raw, path, model_optional, owned)


async def test_a_big_body_being_parsed_does_not_hold_a_small_request(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvgate in this process (the edge helper's default shape: the hook is set here): a chat body of
    4 MB held in the parsing process, a small request is answered; let go, the big one goes up whole
    (the gateway's members spliced in)."""
    monkeypatch.setattr(parsing, "parse", held_parse)
    gate = tmp_path / "gate"
    doc = {**big("chat", SIZE), "x_gate": str(gate)}
    raw = orjson.dumps(doc)
    headers = {"Content-Type": "application/json"}
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:

        async def send_big() -> tuple[int, bytes]:
            async with http.post(
                edge.url + "/v1/chat/completions", data=io.BytesIO(raw), headers=headers
            ) as r:
                return r.status, await r.read()

        heavy = asyncio.ensure_future(send_big())
        started = gate.with_suffix(".started")
        await eventually(started.exists, "the big body is being parsed", within=60)
        assert int(started.read_text()) != os.getpid()  # in the parsing process, not kvgate's
        small = {"model": "tenant-42", "prompt": "hello", "max_tokens": 1}
        async with http.post(edge.url + "/v1/completions", json=small) as r:
            assert r.status == 200, await r.text()
        assert not heavy.done()  # the small request was answered while the big body was still parsed
        assert edge.stub.received[-1]["prompt"] == "hello"
        gate.touch()
        status, answer = await asyncio.wait_for(heavy, timeout=60)
        assert status == 200, answer[:300]
    sent = edge.stub.received[-1]
    assert sent["cache_salt"].startswith("kvg-")  # the gateway's namespace
    assert sent == {**doc, "model": edge.versioned, "cache_salt": sent["cache_salt"]}  # whole, unchanged


def test_bounded_leaves_out_big_members_but_keeps_what_the_path_reads() -> None:
    messages = [{"role": "user", "content": "x" * 1000}] * 1000
    doc = {"model": "m", "user": "u", "stream": True, "previous_response_id": "r",
           "tools": [{"a": "b" * 20_000}], "messages": messages, "n": 2}  # fmt: skip
    body = body_module.bounded(decode(json.dumps(doc).encode()))
    assert body.raw == b""
    assert {k: body.doc[k] for k in ("model", "user", "stream", "previous_response_id", "n")} == {
        "model": "m", "user": "u", "stream": True, "previous_response_id": "r", "n": 2,
    }  # fmt: skip
    assert "tools" not in body.doc
    assert body.doc["messages"] == messages[: len(body.doc["messages"])]
    assert 60 < len(body.doc["messages"]) < 80  # those that show in the first PREFIX_CHARS characters
    assert body.head == prompt_text(doc)


async def test_a_parsing_process_that_dies_fails_no_request_and_is_counted() -> None:
    """The parsing process killed: that body is parsed in a thread (counted ``thread``), the next one in
    a new parsing process (``process``)."""
    metrics = Metrics(CollectorRegistry())
    parser = BodyParser(None, metrics)
    raw = orjson.dumps(big("token ids", 200_000))
    counted = metrics.large_bodies
    try:
        first, _ = await parser.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())
        assert parser.pool is not None
        (child,) = parser.pool._processes.values()  # the one process this parser started
        child.kill()
        await eventually(
            lambda: parser.pool is None or bool(parser.pool._broken), "the pool saw its process die"
        )
        again, _ = await parser.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())
        after, _ = await parser.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())
    finally:
        parser.close()
    assert first.head == after.head == prompt_text(again.doc)  # the thread gives the whole body
    assert forwarded(again, {"model": "v"}) == forwarded(first, {"model": "v"})
    assert counted.labels("thread")._value.get() == 1
    assert counted.labels("process")._value.get() == 2
