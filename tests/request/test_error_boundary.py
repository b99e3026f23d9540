"""One error boundary: whatever a client sends, kvgate answers an OpenAI-style JSON error, never a plain-text
500 with a traceback; a client's error is one log line, kvgate's own bug is one traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import openai
import pytest
import zmq
import zmq.asyncio
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.errors import InvalidAdapter
from gateway.core.identity import check_digest, check_logical_id, versioned_name
from gateway.process.http_edge import free_port, running
from gateway.request.stages import Targeting
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.telemetry.metrics import Metrics
from tests.kv.test_kv_follower import captured
from tests.kv.test_tokens import model_dir  # noqa: F401  (a small real tokenizer for precise routing)
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.edge import ADMIN_TOKEN, assert_openai_error, http_request, kvgate, raw_request
from tests.support.serve_modes import (
    IN_PROCESS_ONLY,
    serve_shape,  # noqa: F401  (autouse: every test here runs in both shapes)
)
from tests.support.stub_backend import StubState, build_stub


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", data=body, headers=headers) as response,
    ):
        return response.status, response.headers.get("Content-Type", ""), await response.read()


async def test_json_nested_5000_deep_is_a_400_not_a_500(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    deep = b'{"model":"tenant-42","prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        status, content_type, body = await post(edge.url, deep)
    error = assert_openai_error(content_type, body, status)
    assert status == 400
    assert error["type"] == "invalid_request_error"
    assert "not valid JSON" in error["message"]
    assert edge.stub.received == []


async def test_json_deeper_than_kvgate_forwards_is_a_clear_400(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """Valid JSON, but nested deeper than the body can be written out again for the replica."""
    for model in (b"tenant-42", b"base"):
        deep = b'{"model":"' + model + b'","prompt":"x","tools":' + b"[" * 400 + b"]" * 400 + b"}"
        async with kvgate(redis, tmp_path / model.decode(), make_adapter) as edge:
            status, content_type, body = await post(edge.url, deep)
        error = assert_openai_error(content_type, body, status)
        assert status == 400
        assert "nested" in error["message"]
        assert edge.stub.received == []


async def test_a_non_utf8_admin_token_is_refused_and_never_a_500(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        for token in (b"\xff\xfe", ADMIN_TOKEN.encode() + b"\xff", b"\xc3"):
            status_request = http_request("GET", "/kvgate/status", {"x-kvgate-admin-token": token})
            answer = await raw_request(edge.url, status_request)
            error = assert_openai_error(answer.headers["content-type"], answer.body, answer.status)
            assert (answer.status, error["type"]) == (401, "authentication_error")
            cold = http_request(
                "POST",
                "/v1/completions",
                {"x-kvgate-admin-token": token, "x-kvgate-namespace": b"cold"},
                b'{"model":"tenant-42","prompt":"x"}',
            )
            answer = await raw_request(edge.url, cold)
            assert_openai_error(answer.headers["content-type"], answer.body, answer.status)
            assert answer.status == 401
        assert edge.stub.received == []


async def test_a_header_is_compared_as_utf8_bytes_and_a_non_utf8_one_never_authenticates(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    # A token that came from a non-UTF-8 environment variable holds a surrogate escape (\udcff): the raw
    # byte 0xff in a header must not match it.
    for token, header, status in (
        ("tökén", "tökén".encode(), 200),
        ("tökén", "tökén".encode("latin-1"), 401),
        ("\udcff", b"\xff", 401),
    ):
        async with kvgate(redis, tmp_path / str(status), make_adapter, admin_token=token) as edge:
            request = http_request("GET", "/kvgate/status", {"x-kvgate-admin-token": header})
            answer = await raw_request(edge.url, request)
        assert answer.status == status, (token, header, answer.body)


def test_a_logical_id_or_digest_with_a_trailing_newline_is_invalid() -> None:
    for logical_id in ("tenant-42\n", "tenant-42\r", "\ntenant-42", "tenant-42\n\n"):
        with pytest.raises(InvalidAdapter):
            check_logical_id(logical_id)
    assert check_logical_id("tenant-42") == "tenant-42"
    with pytest.raises(InvalidAdapter):
        check_digest("a" * 64 + "\n")


async def test_publish_refuses_a_logical_id_with_a_trailing_newline_and_writes_nothing(
    table: EpochTable, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(InvalidAdapter):
        await publish_adapter(table, store, "tenant-42\n", make_adapter(), "base")
    assert not store.root.exists() or list(store.root.iterdir()) == []
    assert await table.read_state("tenant-42\n") is None


async def test_a_request_for_an_id_with_a_newline_is_a_clean_404(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    """A table written before IDs were checked whole (or by hand) may hold one: it is never served."""
    bad, digest = "tenant-42\n", "ab" * 32
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        await edge.table.publish(bad, digest, versioned_name(bad, digest), str(tmp_path / "x"), "base")
        for model in (b'"tenant-42\\n"', b'"base\\n"', b'"tenant-42\\u0000"'):
            status, content_type, body = await post(edge.url, b'{"model":' + model + b',"prompt":"x"}')
            error = assert_openai_error(content_type, body, status)
            assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    assert edge.stub.loads == []
    assert edge.stub.received == []


@IN_PROCESS_ONLY  # a monkeypatch and caplog reach into this process only
async def test_an_unexpected_exception_is_a_json_500_logged_once_with_its_traceback(
    redis: Redis,
    tmp_path: Path,
    make_adapter: MakeAdapter,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(self: Targeting, parsed: object, caller: object) -> None:
        raise RuntimeError("a bug in kvgate, with a secret detail")

    monkeypatch.setattr(Targeting, "resolve", broken)
    caplog.set_level(logging.INFO)
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        status, content_type, body = await post(edge.url, b'{"model":"tenant-42","prompt":"x"}')
    error = assert_openai_error(content_type, body, status)
    assert (status, error["type"]) == (500, "internal_error")
    assert "secret detail" not in error["message"]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert isinstance(tracebacks[0].exc_info[1], RuntimeError)  # type: ignore[index]


@IN_PROCESS_ONLY  # caplog sees this process's log records only
async def test_a_client_error_is_one_log_line_without_a_traceback(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        status, _, _ = await post(edge.url, b'{"model":"no-such\\nmodel","prompt":"x"}')
    assert status == 404
    lines = [r for r in caplog.records if r.name == "gateway.request.boundary"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None
    assert "\n" not in lines[0].getMessage()
    assert "404" in lines[0].getMessage()


@IN_PROCESS_ONLY  # caplog sees this process's log records only
async def test_malformed_http_is_a_json_400_and_one_log_line(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        bad_header = b"GET /healthz HTTP/1.1\r\nHost: kvgate\r\nBad Header\r\nConnection: close\r\n\r\n"
        answer = await raw_request(edge.url, bad_header)
        assert answer.status == 400
        error = assert_openai_error(answer.headers["content-type"], answer.body, answer.status)
        assert "malformed HTTP request" in error["message"]
        too_long = b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: kvgate\r\nConnection: close\r\n\r\n"
        answer = await raw_request(edge.url, too_long)
        assert answer.status in {400, 414}
        assert_openai_error(answer.headers["content-type"], answer.body, answer.status)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 2, [r.getMessage() for r in records]
    for record in records:
        assert record.exc_info is None, record.getMessage()
        assert "\n" not in record.getMessage()
        assert "127.0.0.1" in record.getMessage()


async def test_routing_errors_are_openai_errors(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter
) -> None:
    async with kvgate(redis, tmp_path, make_adapter) as edge, aiohttp.ClientSession() as http:
        async with http.get(edge.url + "/v1/nope") as response:
            error = assert_openai_error(response.content_type, await response.read(), response.status)
            assert (response.status, error["type"]) == (404, "invalid_request_error")
        async with http.put(edge.url + "/v1/completions") as response:
            error = assert_openai_error(response.content_type, await response.read(), response.status)
            assert (response.status, error["type"]) == (405, "invalid_request_error")
            assert "POST" in response.headers["Allow"]


async def test_a_body_that_is_not_what_its_content_encoding_says_is_a_400(
    redis: Redis, tmp_path: Path, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with kvgate(redis, tmp_path, make_adapter) as edge:
        headers = {"Content-Encoding": b"gzip", "Content-Type": b"application/json"}
        request = http_request("POST", "/v1/completions", headers, b'{"model":"tenant-42","prompt":"x"}')
        answer = await raw_request(edge.url, request)
    error = assert_openai_error(answer.headers["content-type"], answer.body, answer.status)
    assert (answer.status, error["type"]) == (400, "invalid_request_error")
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


@IN_PROCESS_ONLY  # one real publisher feeds the in-process kvgate's follower
@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_of_token_ids_out_of_range_is_a_400(
    redis: Redis,
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    """Precise routing on (two replicas, the tokenizer, one replica's view learned from a real ZMQ
    publisher): a completion prompt of token ids with one of 2^63 or -1 in a full block is a 400 naming
    ``prompt``, streaming or not, and reaches no replica; chat (kvgate tokenizes its text) still serves."""
    caplog.set_level(logging.INFO)
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.XPUB)
    publisher.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher.bind(endpoint)
    states, metrics = (StubState(), StubState()), Metrics()
    try:
        async with running(build_stub(states[0])) as url_a, running(build_stub(states[1])) as url_b:
            settings = Settings(replicas=[url_a, url_b], store=tmp_path / "store", admin_token=ADMIN_TOKEN,
                                reconcile_interval=0.1, poll_interval=0.1, kv_events=True,
                                tokenizer=model_dir, kv_event_endpoints=[f"{url_a}={endpoint}"])  # fmt: skip
            async with (
                running(build_app(settings, redis, metrics=metrics)) as url,
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
            ):
                assert await publisher.poll(20_000), "the follower subscribed"
                await publisher.recv()
                await publisher.send_multipart(captured("map_frames.json")[0])  # blocks of 128 tokens
                stored = {"replica": url_a, "kind": "BlockStored"}
                await eventually(
                    lambda: metrics.registry.get_sample_value("kvgate_kv_events_total", stored) == 1,
                    "replica a's view holds blocks (its block size is known)",
                )
                for prompt in ([7] * 127 + [1 << 63], [[7] * 128, [-1] * 128]):
                    with pytest.raises(openai.BadRequestError) as refused:
                        await api.completions.create(model="base", prompt=prompt, max_tokens=1, stream=stream)
                    error = refused.value.body
                    assert isinstance(error, dict)
                    assert error["param"] == "prompt"
                    assert "out of range" in error["message"]
                chat = await api.chat.completions.create(
                    model="base", messages=[{"role": "user", "content": "the lazy dog"}], max_tokens=1,
                    stream=stream,
                )  # fmt: skip
                if stream:
                    assert [chunk async for chunk in chat]  # type: ignore[union-attr]
        assert [len(s.received) for s in states] == [0, 1] or [len(s.received) for s in states] == [1, 0]
        assert [r.getMessage() for r in caplog.records if r.exc_info] == [], "no traceback"
    finally:
        publisher.close()
        context.term()
