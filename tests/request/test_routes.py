"""Every vLLM model route through kvgate, against fast stubs, a real Redis and the official openai client:
the model rewritten both ways on each, the gateway's cache namespace only where vLLM takes one, no model
is the base model, /v1/responses streamed and followed up on the replica that stores it, multipart audio,
/v1/models/{id}, unknown models 404, replica internals never reachable, API keys respected on every route.
(The real-vLLM side is ``tests/vllm/test_routes_vllm.py``.)"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.core.wire import (
    ADMIN_TOKEN_HEADER,
    PIN_HEADER,
    replica_id,
    response_id,
    response_owner,
    response_parts,
)
from gateway.request.routes import ROUTES
from gateway.table.callers import CallerTable
from tests.request.test_proxy import ADMIN_TOKEN, Gateway, client, stubs
from tests.request.test_proxy import gateway as gateway  # the fixture: kvgate in front of the stubs
from tests.support.stub_backend import REPLICA_ONLY, StubState

NAMESPACED = {route.path for route in ROUTES if route.namespaced}
JSON_ROUTES = ["/v1/embeddings", "/tokenize", "/detokenize", "/v1/score", "/score", "/v1/rerank", "/rerank",
               "/v2/rerank", "/pooling", "/classify", "/v1/messages", "/inference/v1/generate"]  # fmt: skip
AUDIO_ROUTES = ["/v1/audio/transcriptions", "/v1/audio/translations"]


async def call(
    url: str,
    path: str,
    *,
    method: str = "POST",
    body: dict[str, Any] | None = None,
    data: aiohttp.FormData | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{url}{path}", json=body, data=data, headers=headers) as response,
    ):
        return response.status, await response.read(), dict(response.headers)


def keyed(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def served_by(backends: list[tuple[str, StubState]], headers: dict[str, str]) -> StubState:
    return next(state for u, state in backends if replica_id(u) == headers["x-kvgate-replica"])


def error_of(body: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(body)
    assert set(doc) == {"error"}, doc
    return dict(doc["error"])


async def test_every_json_route_rewrites_the_model_both_ways(gateway: Gateway, publish: Any) -> None:
    async with stubs(2) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([u for u, _ in backends]) as url:
            answers, forwarded = {}, {}
            for path in JSON_ROUTES:
                body = {"model": "tenant-42", "input": "hi", "cache_salt": "client-chosen"}
                answers[path] = await call(url, path, body=body)
                forwarded[path] = served_by(backends, answers[path][2]).routed[-1]
            async with client(url) as api:
                embedded = await api.embeddings.create(model="tenant-42", input="hi")
    assert embedded.model == "tenant-42"
    for path, (status, payload, headers) in answers.items():
        assert status == 200, (path, payload)
        assert json.loads(payload)["model"] == "tenant-42", path
        assert v1.encode() not in payload, path
        assert headers["x-kvgate-version"] == v1
        sent_path, sent = forwarded[path]
        assert (sent_path, sent["model"], sent["input"]) == (path, v1, "hi")
        if path in NAMESPACED:
            assert sent["cache_salt"].startswith("kvg-"), path
        else:
            assert "cache_salt" not in sent, f"{path}: vLLM's request model takes no cache_salt"
    assert {
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/v1/score",
        "/v1/rerank",
        "/v1/messages",
    } <= NAMESPACED
    assert not NAMESPACED & {"/tokenize", "/detokenize"}


async def test_without_a_model_a_route_that_allows_it_reaches_the_base(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]]) as url:
        tokenized = await call(url, "/tokenize", body={"prompt": "hi"})
        embedded = await call(url, "/v1/embeddings", body={"input": "hi", "model": None})
        messages = await call(url, "/v1/messages", body={"messages": []})
    state = backends[0][1]
    assert tokenized[0] == embedded[0] == 200
    assert json.loads(tokenized[1])["model"] == json.loads(embedded[1])["model"] == "base"
    assert "x-kvgate-version" not in tokenized[2]
    assert [path for path, _ in state.routed] == ["/tokenize", "/v1/embeddings"]
    assert state.routed[0][1] == {"prompt": "hi"}, "the client's body as it came"
    assert messages[0] == 400, "vLLM's /v1/messages requires a model"
    assert error_of(messages[1])["param"] == "model"


async def test_unknown_models_are_404_on_every_route(gateway: Gateway) -> None:
    async with stubs(1) as backends, gateway([backends[0][0]]) as url:
        answers = [await call(url, path, body={"model": "nope", "input": "x"}) for path in JSON_ROUTES]
        form = aiohttp.FormData({"model": "tenant-9@0123456789abcdef"})
        form.add_field("file", b"RIFF", filename="a.wav")
        answers.append(await call(url, AUDIO_ROUTES[0], data=form))
        answers.append(await call(url, "/v1/models/nope", method="GET"))
        answers.append(await call(url, "/v1/responses", body={"model": "nope", "input": "x"}))
    for status, payload, _ in answers:
        assert status == 404
        assert error_of(payload)["code"] == "model_not_found"
    assert backends[0][1].routed == [], "an unknown model never reaches a replica"


async def test_replica_internals_are_never_exposed(gateway: Gateway) -> None:
    hidden = [*REPLICA_ONLY, ("GET", "/health"), ("POST", "/v1/load_lora_adapter"),
              ("POST", "/v1/unload_lora_adapter"), ("POST", "/reset_prefix_cache")]  # fmt: skip
    async with stubs(1) as backends, gateway([backends[0][0]]) as url:
        direct = await call(backends[0][0], "/metrics", method="GET")
        answers = [await call(url, path, method=method, body={"model": "base"}) for method, path in hidden]
    assert direct[0] == 200, "the stub serves them: a 404 through kvgate is kvgate's"
    state = backends[0][1]
    for (method, path), (status, payload, _) in zip(hidden, answers, strict=True):
        assert b"replica internals" not in payload, (method, path)
        if (method, path) != ("GET", "/metrics"):  # kvgate's own metrics are on its admin surface
            assert status in (404, 405), (method, path)
            assert error_of(payload)["type"] in ("not_found_error", "invalid_request_error")
    assert state.routed == [], "nothing reached the replica"
    assert state.loads == []
    assert state.resets == 0


async def test_responses_stream_and_follow_ups_reach_the_replica_that_stores_them(
    gateway: Gateway, publish: Any
) -> None:
    async with stubs(2) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([u for u, _ in backends]) as url:
            body = {"model": "tenant-42", "input": "hi", "stream": True, "request_id": "resp_mine"}
            status, streamed, headers = await call(url, "/v1/responses", body=body)
            async with client(url) as api:
                made = await api.responses.create(model="tenant-42", input="hi")
                fetched = await api.responses.retrieve(made.id)
                follow = await api.responses.create(
                    model="tenant-42", input="more", previous_response_id=made.id
                )
                cancelled = await api.responses.cancel(made.id)
                with pytest.raises(openai.NotFoundError) as unknown:
                    await api.responses.retrieve("resp_0123")
                gone = response_id("http://127.0.0.1:1", None)  # a well-formed id for no replica of ours
                with pytest.raises(openai.NotFoundError) as elsewhere:
                    await api.responses.retrieve(gone)
                with pytest.raises(openai.NotFoundError) as bad_previous:
                    await api.responses.create(model="tenant-42", input="x", previous_response_id="resp_0123")
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in streamed.decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_text.delta",
        "response.completed",
    ]
    assert events[0]["response"]["model"] == events[-1]["response"]["model"] == "tenant-42"
    assert v1.encode() not in streamed
    streamed_id = events[-1]["response"]["id"]
    assert streamed_id.startswith("resp_r-"), "kvgate mints the response id"
    assert streamed_id != "resp_mine", "a client's request_id is not kept: the id must name the replica"
    holder = served_by(backends, headers)
    assert streamed_id in holder.responses
    assert made.model == fetched.model == follow.model == cancelled.model == "tenant-42"
    assert fetched.id == made.id
    assert cancelled.status == "cancelled"
    assert follow.previous_response_id == made.id
    (stored_on,) = [state for _, state in backends if made.id in state.responses]
    assert follow.id in stored_on.responses, "a continuation runs where its previous response is stored"
    followups = [path for path, _ in stored_on.routed if path.startswith(f"/v1/responses/{made.id}")]
    assert followups == [f"/v1/responses/{made.id}", f"/v1/responses/{made.id}/cancel"]
    assert unknown.value.status_code == elsewhere.value.status_code == bad_previous.value.status_code == 404
    assert bad_previous.value.body["param"] == "previous_response_id"  # type: ignore[index]
    sent = [body for _, state in backends for path, body in state.routed if path == "/v1/responses"]
    assert len(sent) == 3, sent  # the stream, made, follow (all() of nothing would pass)
    assert all(b["model"] == v1 and b["cache_salt"].startswith("kvg-") for b in sent)


async def test_each_replicas_responses_are_fetched_from_that_replica(gateway: Gateway, publish: Any) -> None:
    async with stubs(2) as backends:
        await publish("tenant-42", b"v1")
        async with gateway([u for u, _ in backends]) as url, client(url) as api:
            made = []
            for replica_url, _ in backends:  # one stored response on each replica
                pinned = {PIN_HEADER: replica_url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
                made.append(await api.responses.create(model="tenant-42", input="hi", extra_headers=pinned))
            fetched = [await api.responses.retrieve(response.id) for response in made]
    assert [f.id for f in fetched] == [m.id for m in made]
    for (replica_url, state), response in zip(backends, made, strict=True):
        assert response.id.startswith(f"resp_{replica_id(replica_url)}-")
        assert (f"/v1/responses/{response.id}", {}) in state.routed, "fetched where it is stored"


async def test_audio_is_multipart_with_the_model_rewritten(gateway: Gateway, publish: Any) -> None:
    audio = bytes(range(256)) * 40
    async with stubs(1) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url:
            async with client(url) as api:
                heard = await api.audio.transcriptions.create(model="tenant-42", file=("a.wav", audio))
            form = aiohttp.FormData({"model": "tenant-42"})  # (the openai client deprecates translations)
            form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
            translated = json.loads((await call(url, AUDIO_ROUTES[1], data=form))[1])
            form = aiohttp.FormData({"model": "tenant-42", "stream": "true", "cache_salt": "mine"})
            form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
            status, streamed, headers = await call(url, AUDIO_ROUTES[0], data=form)
    assert heard.text == translated["text"] == f"heard {len(audio)} bytes"
    state = backends[0][1]
    assert [path for path, _ in state.routed] == [*AUDIO_ROUTES, AUDIO_ROUTES[0]]
    for _, fields in state.routed:
        assert fields["model"] == v1
        assert fields["file"] == audio
        assert "cache_salt" not in fields
    assert status == 200
    assert headers["x-kvgate-version"] == v1
    assert b'"model":"tenant-42"' in streamed
    assert v1.encode() not in streamed


async def test_models_by_id_answer_under_the_logical_id(gateway: Gateway, publish: Any) -> None:
    async with stubs(1) as backends:
        v1 = await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url, client(url) as api:
            card = await api.models.retrieve("tenant-42")
            base = await api.models.retrieve("base")
            raw = await call(url, "/v1/models/tenant-42", method="GET")
    assert card.id == "tenant-42"
    assert card.model_extra is not None
    assert card.model_extra["parent"] == "base"
    assert card.model_extra["root"] == "tenant-42", "the store path stays kvgate's"
    assert base.id == "base"
    assert v1.encode() not in raw[1]
    assert raw[2]["x-kvgate-version"] == v1
    assert backends[0][1].loads == [v1], "the card is the one a replica serving the version lists"


async def test_api_keys_limit_every_route(gateway: Gateway, publish: Any, redis: Redis) -> None:
    await publish("tenant-a", b"a")
    await publish("tenant-b", b"b")
    table = CallerTable(redis)
    key_a, _ = await table.create("acme", ["tenant-a"], base=False)
    key_b, _ = await table.create("bolt", ["tenant-a", "tenant-b"], base=True)
    async with stubs(1) as backends, gateway([backends[0][0]], auth="api-keys") as url:
        as_a = {"Authorization": f"Bearer {key_a}"}
        refused = [
            await call(url, "/v1/embeddings", body={"model": "tenant-b", "input": "x"}, headers=as_a),
            await call(url, "/tokenize", body={"prompt": "x"}, headers=as_a),  # the base: not granted
            await call(url, "/v1/models/tenant-b", method="GET", headers=as_a),
            await call(url, "/v1/models/base", method="GET", headers=as_a),
            await call(url, "/v1/responses", body={"model": "tenant-b", "input": "x"}, headers=as_a),
        ]
        form = aiohttp.FormData({"model": "tenant-b"})
        form.add_field("file", b"RIFF", filename="a.wav")
        refused.append(await call(url, AUDIO_ROUTES[0], data=form, headers=as_a))
        async with keyed(url, key_b) as api_b, keyed(url, key_a) as api_a:
            theirs = await api_b.responses.create(model="tenant-a", input="x")
            with pytest.raises(openai.NotFoundError):
                await api_a.responses.retrieve(theirs.id)
            with pytest.raises(openai.NotFoundError):
                await api_a.responses.cancel(theirs.id)
            with pytest.raises(openai.NotFoundError):
                await api_a.responses.create(model="tenant-a", input="x", previous_response_id=theirs.id)
            mine = await api_b.responses.retrieve(theirs.id)
            allowed = await api_a.embeddings.create(model="tenant-a", input="x")
        unauthenticated = await call(url, "/v1/embeddings", body={"model": "tenant-a", "input": "x"})
    assert [status for status, _, _ in refused] == [404] * len(refused)
    assert mine.id == theirs.id
    assert allowed.model == "tenant-a"
    assert unauthenticated[0] == 401
    paths = [path for path, _ in backends[0][1].routed]
    assert paths == ["/v1/responses", f"/v1/responses/{theirs.id}", "/v1/embeddings"]


def test_minted_response_ids_name_their_replica_and_owner() -> None:
    minted = response_id("http://10.0.0.5:8000", "acme")
    assert response_parts(minted) == (replica_id("http://10.0.0.5:8000"), response_owner("acme"))
    assert len({response_owner("acme"), response_owner("bolt"), response_owner(None)}) == 3
    assert response_id("http://10.0.0.5:8000", "acme") != minted, "random: unguessable like vLLM's"
    vllms_own = "resp_" + "0123456789abcdef" * 2
    for foreign in [vllms_own, minted + "0", minted.upper(), minted.removeprefix("resp_"), minted + "\n"]:
        assert response_parts(foreign) is None, foreign


def test_the_route_table_is_one_row_per_route_and_hides_replica_internals() -> None:
    keys = [(route.method, route.path) for route in ROUTES]
    assert len(keys) == len(set(keys))
    paths = {route.path for route in ROUTES}
    internals = {path for _, path in REPLICA_ONLY} | {
        "/health",
        "/v1/load_lora_adapter",
        "/reset_prefix_cache",
    }
    assert not paths & internals
    assert [route.path for route in ROUTES if route.mints_response_id] == ["/v1/responses"]


def _raw_form(model_part: bytes, *, charset: str | None = None) -> tuple[bytes, dict[str, str]]:
    """A multipart body by hand: a ``model`` text part holding ``model_part`` as is, and a file."""
    boundary = "kvgateBoundary"
    declared = f"Content-Type: text/plain; charset={charset}\r\n" if charset else ""
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n{declared}\r\n'.encode()
        + model_part
        + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\n".encode()
        + b"RIFF...."
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


@pytest.mark.parametrize(
    ("model_part", "charset"), [(b"tenant-\xff\xfe42", None), (b"tenant-\xe9", "utf-8"), (b"t", "no-such")]
)
async def test_a_form_whose_text_is_not_in_its_charset_is_a_400(
    gateway: Gateway, publish: Any, model_part: bytes, charset: str | None
) -> None:
    """A ``model`` field that is not UTF-8 (or names a charset that does not exist) was a 500 with a
    traceback; it is the client's error, said in an OpenAI-style body, and nothing reaches a replica."""
    async with stubs(1) as backends:
        await publish("tenant-42", b"v1")
        async with gateway([backends[0][0]]) as url:
            body, headers = _raw_form(model_part, charset=charset)
            async with aiohttp.ClientSession() as http:
                for path in AUDIO_ROUTES:
                    async with http.post(f"{url}{path}", data=body, headers=headers) as response:
                        status, answer = response.status, await response.read()
                    assert status == 400, answer
                    error = error_of(answer)
                    assert error["type"] == "invalid_request_error"
                    assert "must be text in its part's charset" in error["message"]
                good, headers = _raw_form(b"tenant-42")
                async with http.post(f"{url}{AUDIO_ROUTES[0]}", data=good, headers=headers) as response:
                    assert response.status == 200, await response.read()
    assert [path for path, _ in backends[0][1].routed] == [AUDIO_ROUTES[0]]


MALFORMED_FORMS = {
    "cut short": (b'--B\r\nContent-Disposition: form-data; name="model"\r\n\r\ntenant-42', "boundary=B"),
    "no boundary": (b"model=tenant-42", ""),
    "another boundary": (b"--C\r\n\r\n", "boundary=B"),
    "a part with no name": (b"--B\r\n\r\nx\r\n--B--\r\n", "boundary=B"),
    "a name not UTF-8": (
        b'--B\r\nContent-Disposition: form-data; name="\xff"\r\n\r\nx\r\n--B--\r\n',
        "boundary=B",
    ),
}


@pytest.mark.parametrize("case", MALFORMED_FORMS)
async def test_a_malformed_form_is_a_400(gateway: Gateway, case: str) -> None:
    """Each was a 500 (aiohttp's ValueError, or a name with surrogates failing on the way upstream)."""
    body, parameter = MALFORMED_FORMS[case]
    content_type = "multipart/form-data" + (f"; {parameter}" if parameter else "")
    headers = {"Content-Type": content_type}
    async with (
        stubs(1) as backends,
        gateway([backends[0][0]]) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}{AUDIO_ROUTES[0]}", data=body, headers=headers) as response,
    ):
        status, answer = response.status, await response.read()
    assert status == 400, answer
    assert error_of(answer)["type"] == "invalid_request_error"
    assert backends[0][1].routed == []
