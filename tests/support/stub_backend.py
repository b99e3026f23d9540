"""A fast stub that follows vLLM's documented API, for proxy edge cases and load tests.

Never a stand-in for vLLM in the integration tests (those run the real server). It records the
last request body it received so tests can see exactly what kvgate forwarded. It can answer at an
LLM's pace (``chunk_delay`` per SSE chunk, ``reply_delay`` before a non-streaming answer) and counts
completions whose caller left before the end (``cancelled``), as a replica that stops a generation does.
``GET /stub/stats`` reports the counters and ``GET /stub/prompts`` how often each prompt came (a prompt
seen twice is a duplicate upstream request), for load tests that run the stub as its own process.
A model it does not have is refused with vLLM 0.32's exact 404 body; each unload records how many
requests on that name were in flight at that moment (``unloads``): a budget test's proof that no
eviction took an adapter from under a request.
kvgate's base-fingerprint probe (``core.base_print.PROBE_PROMPTS`` on the base model) is answered as vLLM
answers it (a choice per prompt, its first token's top logprobs) with logprobs that follow ``weights``
(change it: another base under the same name; ``odd_probes``: the weights of the next few probe answers
only, a replica that answers odd once), counted in ``probes``, apart from the requests tests look at.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import TypeAdapter, ValidationError

from gateway.core.base_print import PROBE_PROMPTS, TOP_K

_STREAM = TypeAdapter(bool | None)  # vLLM's request models declare ``stream: bool | None`` (lax)


@dataclass
class StubState:
    base: str = "base"
    base_root: str = "/models/tiny"
    started: float = field(default_factory=time.time)  # process_start_time_seconds in its /metrics
    adapters: dict[str, str] = field(default_factory=dict)
    received: list[dict[str, Any]] = field(default_factory=list)
    received_headers: list[dict[str, str]] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    fail_loads: str | None = None
    check_paths: bool = False  # as vLLM: a load whose lora_path holds no adapter_config.json is a 404
    fail_loads_of: str | None = None  # loads of a name containing this fail (fail_loads: every load)
    load_delay: float = 0.0  # seconds a load takes
    load_requests: int = 0  # load requests received (answered or not)
    busy_resets: int = 0  # /reset_prefix_cache answers {"success": false} this many times first
    resets: int = 0
    chunks: int = 4
    break_stream_after: int | None = None
    chunk_delay: float = 0.0  # seconds before each SSE chunk
    reply_delay: float = 0.0  # seconds before a non-streaming answer
    completions: int = 0  # completion requests received (never trimmed, unlike ``received``)
    cancelled: int = 0  # completions whose caller left (connection closed) before the end
    finished: int = 0  # completions answered to the end
    prompts: Counter[str] = field(default_factory=Counter)  # completions per prompt
    hold: asyncio.Event | None = None  # a stream pauses after its first chunk until this is set
    listings: int = 0  # GET /v1/models answered or being answered
    listing_gate: asyncio.Event | None = None  # while set to an unset event, /v1/models waits for it
    routed: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (path, body or form) per
    # request on the other model routes (embeddings, responses, tokenize, audio, ...)
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)  # stored /v1/responses by id
    echo_errors: bool = False  # completions answer 400 naming the model they were sent
    load_gate: asyncio.Event | None = None  # while set to an unset event, loads wait for it
    error_reply: tuple[int, bytes, str] | None = None  # completions answer (status, body, content type)
    in_flight: Counter[str] = field(default_factory=Counter)  # completions running, per model name
    unloads: list[tuple[str, int]] = field(default_factory=list)  # (name, its requests in flight then)
    weights: int = 0  # the base's "weights": the base-fingerprint probe's answer follows them
    probes: int = 0  # base-fingerprint probes answered
    odd_probes: list[int] = field(default_factory=list)  # weights the next probes answer with, first first
    logprobs: bool = False  # completions asked for ``logprobs`` answer them (and count a token per 4 chars)


STUB = web.AppKey("stub", StubState)


async def _health(request: web.Request) -> web.Response:
    return web.Response()  # vLLM answers 200 with an empty body


async def _models(request: web.Request) -> web.Response:
    state = request.app[STUB]
    state.listings += 1
    if state.listing_gate is not None:  # a replica whose API stalls
        await state.listing_gate.wait()
    data = [{"id": state.base, "object": "model", "root": state.base_root, "parent": None}]
    data += [{"id": n, "object": "model", "root": r, "parent": state.base} for n, r in state.adapters.items()]
    return web.json_response({"object": "list", "data": data})


async def _load(request: web.Request) -> web.Response:
    state = request.app[STUB]
    body = await request.json()
    state.load_requests += 1
    if state.load_delay:
        await asyncio.sleep(state.load_delay)
    if state.load_gate is not None:  # a slow load: it answers once the gate opens
        await state.load_gate.wait()
    if state.fail_loads or (state.fail_loads_of and state.fail_loads_of in body["lora_name"]):
        return web.json_response(
            {"error": {"message": state.fail_loads or "refused", "type": "NotFoundError"}}, status=404
        )
    if state.check_paths and not (Path(body["lora_path"]) / "adapter_config.json").is_file():
        msg = f"No adapter found for {body['lora_path']}"
        return web.json_response({"error": {"message": msg, "type": "NotFoundError"}}, status=404)
    if body["lora_name"] in state.adapters:
        msg = f"The lora adapter '{body['lora_name']}' has already been loaded."
        return web.json_response({"error": {"message": msg, "type": "InvalidUserInput"}}, status=400)
    state.adapters[body["lora_name"]] = body["lora_path"]
    state.loads.append(body["lora_name"])
    return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


async def _unload(request: web.Request) -> web.Response:
    state = request.app[STUB]
    body = await request.json()
    if state.adapters.pop(body["lora_name"], None) is None:
        return web.json_response({"error": {"message": "not found", "type": "NotFoundError"}}, status=404)
    state.unloads.append((body["lora_name"], state.in_flight[body["lora_name"]]))
    return web.Response(text="Success")


async def _complete(request: web.Request) -> web.StreamResponse:
    state = request.app[STUB]
    body = await request.json()
    if body.get("prompt") == list(PROBE_PROMPTS) and body.get("model") == state.base:
        state.probes += 1
        return web.json_response(probe_answer(state.odd_probes.pop(0) if state.odd_probes else state.weights))
    state.received.append(body)
    state.received_headers.append(dict(request.headers))
    state.completions += 1
    state.prompts[str(body.get("prompt", body.get("messages", "")))] += 1
    model = str(body.get("model"))
    state.in_flight[model] += 1
    try:
        response = await _generate(request, state, body)
    except (asyncio.CancelledError, ConnectionResetError):
        state.cancelled += 1  # the caller left: a replica stops the generation here
        raise
    finally:
        state.in_flight[model] -= 1
    state.finished += 1
    return response


async def _generate(request: web.Request, state: StubState, body: dict[str, Any]) -> web.StreamResponse:
    model = body.get("model") or state.base  # vLLM: no model is the served (base) model
    if (refused := _unknown(state, model)) is not None:
        return refused
    if state.error_reply is not None:  # a replica (or a proxy before it) answering in its own words
        status, text, content_type = state.error_reply
        return web.Response(body=text, status=status, content_type=content_type)
    if state.echo_errors:
        error = {"message": f"`{model}` cannot take this request", "type": "BadRequestError",
                 "param": "model", "code": 400}  # fmt: skip
        return web.json_response({"error": error}, status=400)
    chat = request.path.endswith("chat/completions")
    try:
        stream = _STREAM.validate_python(body.get("stream"))
    except ValidationError:
        error = {"message": "stream: Input should be a valid boolean", "type": "BadRequestError",
                 "param": "stream", "code": 400}  # fmt: skip
        return web.json_response({"error": error}, status=400)
    if not stream:
        if state.reply_delay:
            await asyncio.sleep(state.reply_delay)
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        prompt_tokens = 3
        if state.logprobs and not chat and body.get("logprobs") is not None:  # what an audit reads
            choice["logprobs"] = {"token_logprobs": [-0.5], "tokens": ["ok"]}
            prompt_tokens = max(1, len(str(body.get("prompt", ""))) // 4)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
        return web.json_response(
            {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "model": model,
             "choices": [choice], "usage": usage},
            dumps=lambda o: json.dumps(o, separators=(",", ":")),
        )  # fmt: skip
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(state.chunks):
        if state.break_stream_after is not None and i == state.break_stream_after:
            assert request.transport is not None
            request.transport.close()
            return response
        if state.chunk_delay:
            await asyncio.sleep(state.chunk_delay)
        delta = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
        chunk = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
                 "model": model, "choices": [{"index": 0, **delta, "finish_reason": None}]}  # fmt: skip
        await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
        if i == 0 and state.hold is not None:
            await state.hold.wait()
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def probe_answer(weights: int) -> dict[str, Any]:
    """A choice per probe prompt with its first token's top logprobs, as vLLM answers ``logprobs`` K;
    other ``weights`` move every logprob by 0.5 and change the first tokens."""
    choices = []
    for i, _ in enumerate(PROBE_PROMPTS):
        tops = {
            f" t{(i + weights) % 7}{rank}": -1.0 - 0.5 * weights - 0.4 * rank - 0.05 * i
            for rank in range(TOP_K)
        }
        first = next(iter(tops))
        logprobs = {"tokens": [first], "token_logprobs": [tops[first]], "top_logprobs": [tops]}
        choices.append({"index": i, "text": first, "logprobs": logprobs, "finish_reason": "length"})
    usage = {"prompt_tokens": 60, "completion_tokens": len(choices), "total_tokens": 60 + len(choices)}
    return {"id": "cmpl-probe", "object": "text_completion", "choices": choices, "usage": usage}


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    state = request.app[STUB]
    if state.busy_resets > 0:
        state.busy_resets -= 1
        return web.json_response({"success": False})
    state.resets += 1
    return web.json_response({"success": True})


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STUB]
    counts = {"completions": state.completions, "cancelled": state.cancelled, "finished": state.finished}
    return web.json_response(counts)


async def _prompts(request: web.Request) -> web.Response:
    return web.json_response(request.app[STUB].prompts)


def _unknown(state: StubState, model: str) -> web.Response | None:
    if model == state.base or model in state.adapters:
        return None
    error = {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": "model",
             "code": 404}  # fmt: skip
    # vLLM 0.32's answer, byte for byte
    return web.json_response(
        {"error": error}, status=404, dumps=lambda o: json.dumps(o, separators=(",", ":"))
    )


async def _routed(request: web.Request) -> web.StreamResponse:
    """Any other JSON model route: records the body and answers with the model it ran (as vLLM's
    answers carry ``model``); no model is the base model, as in vLLM."""
    state = request.app[STUB]
    body = await request.json()
    state.routed.append((request.path, body))
    model = body.get("model") or state.base
    if (refused := _unknown(state, model)) is not None:
        return refused
    if request.path == "/v1/responses":
        return await _respond(request, state, body, model)
    usage = {"prompt_tokens": 3, "total_tokens": 3}
    data = [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}]
    return web.json_response({"object": request.path, "model": model, "data": data, "usage": usage})


async def _respond(
    request: web.Request, state: StubState, body: dict[str, Any], model: str
) -> web.StreamResponse:
    previous = body.get("previous_response_id")
    if previous is not None and previous not in state.responses:
        msg = f"Response with id '{previous}' not found."
        return web.json_response({"error": {"message": msg, "type": "NotFoundError"}}, status=404)
    rid = body.get("request_id", "resp_stub")
    stored = {"id": rid, "object": "response", "model": model, "status": "completed",
              "previous_response_id": previous, "output": [{"type": "message", "content": "ok"}]}  # fmt: skip
    state.responses[rid] = stored
    if not _STREAM.validate_python(body.get("stream")):
        return web.json_response(stored)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": {**stored, "status": "in_progress"}}),
        ("response.output_text.delta", {"delta": "ok"}),
        ("response.completed", {"response": stored}),
    ]
    for kind, event in events:
        data = json.dumps({"type": kind, **event}, separators=(",", ":"))
        await response.write(f"event: {kind}\ndata: {data}\n\n".encode())
    await response.write_eof()
    return response


async def _stored_response(request: web.Request) -> web.Response:
    """``GET /v1/responses/{id}`` and its cancel: only this replica's own store, as in vLLM."""
    state = request.app[STUB]
    rid = request.match_info["response_id"]
    state.routed.append((request.path, dict(request.query)))
    if rid not in state.responses:
        msg = f"Response with id '{rid}' not found."
        return web.json_response({"error": {"message": msg, "type": "NotFoundError"}}, status=404)
    if request.path.endswith("/cancel"):
        state.responses[rid]["status"] = "cancelled"
    return web.json_response(state.responses[rid])


async def _audio(request: web.Request) -> web.StreamResponse:
    """Transcription and translation: a multipart form with ``model`` and a ``file``."""
    state = request.app[STUB]
    form = await request.post()
    fields: dict[str, Any] = {}
    for name, value in form.items():
        fields[name] = value.file.read() if isinstance(value, web.FileField) else value
    state.routed.append((request.path, fields))
    model = str(fields.get("model") or state.base)
    if (refused := _unknown(state, model)) is not None:
        return refused
    text = f"heard {len(fields.get('file', b''))} bytes"
    if not _STREAM.validate_python(fields.get("stream")):
        return web.json_response({"text": text, "usage": {"type": "duration", "seconds": 1}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"object": "transcription.chunk", "model": model, "choices": [{"delta": {"content": text}}]}
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _replica_only(request: web.Request) -> web.Response:
    """A route a replica serves that kvgate must never expose (health, metrics, admin). ``/metrics`` and
    ``/kv_event_sources`` are not recorded in ``routed``: kvgate reads them itself (the process start
    time, as vLLM's says it; no KV event sources, as vLLM started without ``--kv-events-config`` says)."""
    state = request.app[STUB]
    if request.path == "/metrics":
        return web.Response(text=f"# replica internals\nprocess_start_time_seconds {state.started}\n")
    if request.path == "/kv_event_sources":
        return web.json_response({})
    state.routed.append((request.path, {}))
    return web.Response(text="replica internals")


REPLICA_ONLY = (("GET", "/metrics"), ("GET", "/load"), ("GET", "/version"), ("GET", "/ping"),
                ("POST", "/ping"), ("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/invocations"),
                ("GET", "/server_info"), ("POST", "/collective_rpc"), ("POST", "/start_profile"),
                ("GET", "/kv_event_sources"), ("POST", "/pause"), ("POST", "/update_weights"))  # fmt: skip
"""Routes vLLM serves on the replica itself that kvgate must not pass through (with /health, LoRA
loading and /reset_prefix_cache above)."""


def build_stub(state: StubState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # vLLM has no body limit of its own
    app[STUB] = state
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/load_lora_adapter", _load)
    app.router.add_post("/v1/unload_lora_adapter", _unload)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    for path in ("/v1/embeddings", "/v1/responses", "/tokenize", "/detokenize", "/v1/score", "/score",
                 "/v1/rerank", "/rerank", "/v2/rerank", "/pooling", "/classify", "/v1/messages",
                 "/inference/v1/generate"):  # fmt: skip
        app.router.add_post(path, _routed)
    app.router.add_get("/v1/responses/{response_id}", _stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", _stored_response)
    app.router.add_post("/v1/audio/transcriptions", _audio)
    app.router.add_post("/v1/audio/translations", _audio)
    for method, path in REPLICA_ONLY:
        app.router.add_route(method, path, _replica_only)
    app.router.add_get("/stub/stats", _stats)
    app.router.add_get("/stub/prompts", _prompts)
    return app
