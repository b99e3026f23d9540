"""Large bodies in the body lane (``gateway/request/body_lane.py``): what comes back is bounded by what
routing uses (the leading blocks: the same keys and tokens as a short body with the same start), the body
still goes upstream whole and unchanged, a body being received holds no other request, and a lane that
dies is replaced."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import random
import signal
import socket
from array import array
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from gateway.core import body as body_module
from gateway.core.body import decode, forwarded
from gateway.core.prefix import BLOCK_CHARS, PREFIX_CHARS, content_keys, prompt_text
from gateway.core.wire import ADMIN_TOKEN_HEADER
from gateway.kv.prompt_tokens import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    MAX_CHARS,
    MAX_TOKENS,
    PromptTokens,
    of_route,
)
from gateway.request.body_lane import BodyLane, BodyLost, Handover, HeldUpstream
from gateway.telemetry.metrics import Metrics
from tests.request.test_deadlines import closed, openai_error, read_response
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.edge import ADMIN_TOKEN, kvgate
from tests.support.stub_backend import StubState
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
JSON = {"Content-Type": "application/json"}
LANE_READ = 'kvgate_large_bodies_total{parsed_in="process",read_by="lane"}'


@pytest.fixture
def tokens(tmp_path: Path) -> PromptTokens:
    return PromptTokens.from_path(write_tiny_model(tmp_path / "model"))


def route_of(shape: str) -> str:
    return CHAT_COMPLETIONS if shape == "chat" else COMPLETIONS


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_4mb_body_is_keyed_by_its_leading_blocks_only_as_a_short_body_with_the_same_start(
    shape: str, tokens: PromptTokens
) -> None:
    """The body lane hands back a bounded body: its prefix keys and tokens are those of a short body
    that begins the same way (just past what keys reach), and it forwards the same bytes as the whole."""
    whole_doc = big(shape, SIZE)
    raw = orjson.dumps(whole_doc)
    assert 3_400_000 < len(raw) <= 4 * 1024 * 1024
    short_doc = big(shape, 3 * PREFIX_CHARS)
    lane = BodyLane(tokens)
    try:
        body, big_tokens = await lane.parse(raw, route_of(shape), model_optional=False, owned=frozenset())
    finally:
        lane.close()
    assert body.raw is raw
    crossed = pickle.dumps((body.doc, body.head_keys, big_tokens))  # what the lane handed back
    assert len(crossed) < 4 * PREFIX_CHARS + 8 * MAX_TOKENS  # the tokens: int64s
    short = decode(orjson.dumps(short_doc))
    assert prompt_text(short.doc) == prompt_text(whole_doc)
    assert body.head_keys == tuple(content_keys(prompt_text(whole_doc)))  # the prefix keys' costly part
    assert len(body.head_keys) == PREFIX_CHARS // BLOCK_CHARS
    short_tokens = of_route(tokens, route_of(shape), short.doc)
    assert isinstance(big_tokens, array)
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


async def metric(url: str, line_start: str) -> float:
    """The value of the ``/metrics`` sample whose line starts with ``line_start`` (0 if none)."""
    headers = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", headers=headers) as response:
        assert response.status == 200
        text = await response.text()
    found = [line for line in text.splitlines() if line.startswith(line_start)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


def head_of(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_big_body_still_arriving_holds_no_request_and_goes_up_whole_from_the_lane(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """A 4 MB chat body sent in two parts, the second only after a small request was answered: the body
    lane reads it from the client's socket (counted ``read_by="lane"``), it goes up whole with the
    gateway's members spliced in, and that connection closes after its answer (``Connection: close``)."""
    doc = big("chat", SIZE)
    raw = orjson.dumps(doc)
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        taken = await metric(edge.url, LANE_READ)
        parts = urlsplit(edge.url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head_of("/v1/chat/completions", len(raw)) + raw[: len(raw) // 2])
            await writer.drain()
            small = {"model": "tenant-42", "prompt": "hello", "max_tokens": 1}
            async with http.post(edge.url + "/v1/completions", json=small) as r:
                assert r.status == 200, await r.text()
            assert edge.stub.received[-1]["prompt"] == "hello"  # answered while the big body was arriving
            writer.write(raw[len(raw) // 2 :])
            await writer.drain()
            status, headers, answer = await read_response(reader)
            rest = await closed(reader)
        finally:
            writer.close()
        assert status == 200, answer[:300]
        assert headers["connection"] == "close"
        assert rest == b""
        assert await metric(edge.url, LANE_READ) == taken + 1
    sent = edge.stub.received[-1]
    assert sent["cache_salt"].startswith("kvg-")  # the gateway's namespace
    assert sent == {**doc, "model": edge.versioned, "cache_salt": sent["cache_salt"]}  # whole, unchanged


async def test_a_big_body_sent_after_100_continue_is_read_by_the_lane(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """curl's way with a large body (``Expect: 100-continue``): the body comes only after kvgate's
    100 Continue, so none of it has arrived when the lane takes it; it is answered and goes up whole."""
    doc = big("completion", 1_000_000)
    raw = orjson.dumps(doc)
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        taken = await metric(edge.url, LANE_READ)
        parts = urlsplit(edge.url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            head = head_of("/v1/completions", len(raw)).replace(
                b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"
            )
            writer.write(head)
            await writer.drain()
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            writer.write(raw)
            await writer.drain()
            status, headers, answer = await read_response(reader)
        finally:
            writer.close()
        assert status == 200, answer[:300]
        assert headers["connection"] == "close"
        assert await metric(edge.url, LANE_READ) == taken + 1
    sent = edge.stub.received[-1]
    assert sent == {**doc, "model": edge.versioned, "cache_salt": sent["cache_salt"]}


async def test_a_client_that_leaves_after_its_big_body_cancels_its_request_upstream(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """A big body read by the lane, its answer pending (the stub takes a minute): the client closes its
    connection and kvgate cancels the request upstream, as for any request (the serving process stopped
    reading that connection when it handed the body over, and watches it again once the lane has read it)."""
    stub = StubState(reply_delay=60.0)
    raw = orjson.dumps(big("completion", 1_000_000))
    async with kvgate(redis, tmp_path, make_adapter, stub) as edge, aiohttp.ClientSession() as http:
        taken = await metric(edge.url, LANE_READ)
        parts = urlsplit(edge.url)
        _, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head_of("/v1/completions", len(raw)) + raw[: len(raw) // 2])
            await writer.drain()
            async with http.get(edge.url + "/healthz") as r:  # the big request's handler has started
                assert r.status == 200
            writer.write(raw[len(raw) // 2 :])
            await writer.drain()

            async def upstream() -> bool:
                return stub.completions == 1

            await eventually(upstream, "the request reached the stub, which holds its answer")
        finally:
            writer.close()  # the client leaves, its answer pending

        async def cancelled() -> bool:
            return stub.cancelled == 1

        await eventually(cancelled, "kvgate cancelled the request upstream")
        assert await metric(edge.url, LANE_READ) == taken + 1
    assert stub.finished == 0


@pytest.mark.parametrize("shape", ["token ids", "completion"])
async def test_a_big_body_from_the_lane_is_answered_as_any_other(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, shape: str
) -> None:
    """Through the official path (an HTTP client sending 4 MB in one go): a client's cache namespace is
    never forwarded (the body serialized again, in the lane), bad JSON is a 400, and the next request on
    a new connection is served."""
    doc = {**big(shape, SIZE), "cache_salt": "client-chosen"}
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        async with http.post(
            edge.url + "/v1/completions", data=io.BytesIO(orjson.dumps(doc)), headers=JSON
        ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Connection"] == "close"
        sent = edge.stub.received[-1]
        assert sent == {**doc, "model": edge.versioned, "cache_salt": sent["cache_salt"]}
        assert sent["cache_salt"] != "client-chosen"
        broken = orjson.dumps(doc)[:-1]
        async with http.post(edge.url + "/v1/completions", data=io.BytesIO(broken), headers=JSON) as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        async with http.post(edge.url + "/v1/completions", json={"model": "tenant-42", "prompt": "x"}) as r:
            assert r.status == 200


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
    assert body.head_keys == tuple(content_keys(prompt_text(doc)))


async def test_a_lane_that_dies_fails_no_parse_and_is_replaced() -> None:
    """The lane killed while a body waits on it (stopped first, so the body is surely in its hands): that
    body is parsed in a thread (counted ``thread``), the next one in a new lane (``process``)."""
    metrics = Metrics(CollectorRegistry())
    lane = BodyLane(None, metrics)
    raw = orjson.dumps(big("token ids", 200_000))
    counted = metrics.large_bodies
    try:
        first, _ = await lane.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())
        assert lane.process is not None
        pid = lane.process.pid
        assert pid is not None
        assert pid != os.getpid()
        os.kill(pid, signal.SIGSTOP)
        parsing = asyncio.ensure_future(lane.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset()))
        await eventually(lambda: bool(lane.calls), "the body was sent to the stopped lane")
        os.kill(pid, signal.SIGKILL)
        again, _ = await asyncio.wait_for(parsing, timeout=60)
        after, _ = await lane.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())
        assert lane.generation == 2
        assert lane.process is not None
        assert lane.process.pid != pid
    finally:
        lane.close()
    # the thread gives the whole body
    assert first.head_keys == after.head_keys == tuple(content_keys(prompt_text(again.doc)))
    assert forwarded(again, {"model": "v"}) == forwarded(first, {"model": "v"})
    assert counted.labels("loop", "process")._value.get() == 2
    assert counted.labels("loop", "thread")._value.get() == 1
    assert metrics.body_lane_starts._value.get() == 2


async def test_a_body_held_by_a_lane_that_died_is_lost_not_sent_by_the_next() -> None:
    """The lane took a body (from a socket), then died: sending or fetching that body raises
    ``BodyLost`` (a 503 the client may retry); the lane that starts next does not have it."""
    lane = BodyLane(None)
    raw = orjson.dumps(big("completion", 200_000))
    client, server = socket.socketpair()
    try:
        client.sendall(raw)
        handover = Handover(b"", os.dup(server.fileno()), len(raw), 30.0, 30.0, lambda: None, lambda: None)
        body, _, held = await lane.take(handover, COMPLETIONS, model_optional=False, owned=frozenset())
        os.close(handover.fd or -1)
        assert body.model == "tenant-42"
        assert lane.process is not None
        assert lane.process.pid is not None
        os.kill(lane.process.pid, signal.SIGKILL)
        await eventually(lambda: lane.channel is None, "the serving side saw its lane go")
        upstream = HeldUpstream(held, None)
        with pytest.raises(BodyLost):
            await upstream.fetch()
        await lane.parse(raw, COMPLETIONS, model_optional=False, owned=frozenset())  # a new lane runs
        with pytest.raises(BodyLost):
            await upstream.write(server.fileno(), "POST", "replica", COMPLETIONS, {})
    finally:
        lane.close()
        client.close()
        server.close()


async def test_a_body_held_by_a_lane_that_dies_is_a_503_and_the_next_is_served(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """The lane killed while it reads a body from the client: that request is answered 503 ``body_lost``
    (an OpenAI error), the next large body starts a new lane and is served."""
    raw = orjson.dumps(big("completion", SIZE))
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        parts = urlsplit(edge.url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(head_of("/v1/completions", len(raw)) + raw[: len(raw) // 2])
            await writer.drain()
            lane = await eventually_lane()
            os.kill(lane, signal.SIGKILL)
            status, _, answer = await read_response(reader)
        finally:
            writer.close()
        assert status == 503
        assert openai_error(answer)["code"] == "body_lost"
        async with http.post(edge.url + "/v1/completions", data=io.BytesIO(raw), headers=JSON) as r:
            assert r.status == 200, await r.text()


async def eventually_lane() -> int:
    """The pid of the body lane running now: the one process under this one (kvgate in it, or a
    ``--workers`` kvgate it started) that multiprocessing's spawn started."""
    found: list[int] = []

    def running() -> bool:
        found[:] = [pid for pid, command in descendants() if b"spawn_main" in command]
        return len(found) == 1

    await eventually(running, "one body lane runs")
    return found[0]


def descendants() -> list[tuple[int, bytes]]:
    """(pid, command line) of every process under this one, read from /proc."""
    parents: dict[int, int] = {}
    commands: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # it ended meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    ours, found = {os.getpid()}, []
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in ours and pid not in ours:
                ours.add(pid)
                found.append((pid, commands[pid]))
                grew = True
    return found
