"""A fast stub that follows SGLang's documented API, for the SGLang dialect's tests.

Runtime LoRA: ``POST /load_lora_adapter {lora_name, lora_path, pinned}`` and ``POST /unload_lora_adapter
{lora_name}`` answer ``{success, error_message, loaded_adapters}`` (200 on success, 400 otherwise), and a
same-name load is refused until the name is unloaded. ``/v1/models`` lists the base and, like newer
SGLang, the loaded adapters; ``list_adapters=False`` acts like older SGLang, which lists the base only.
``/flush_cache`` answers 400 while ``busy``; each flush empties the stub's radix cache.

Completions answer greedily with token logprobs that follow what the model is: the base's ``weights``
(change them: another base under the same name), or the bytes an adapter's directory held *when it was
loaded* (as a server reads its weights once), so the same name loaded from other bytes answers otherwise.
The radix cache is keyed as SGLang keys it on the OpenAI endpoints, ``cache_salt + extra_key``, with the
load's own id: a repeated prompt in the same key reports its prompt tokens as cached. Every completion's
body is recorded (``received``; kvgate's base-fingerprint probe, ``core.base_print.PROBE_PROMPTS`` on the
base, in ``probes`` instead). ``run_sglang_stub`` serves it with ``gateway.process.http_edge.running``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.core.base_print import PROBE_PROMPTS
from gateway.process.http_edge import running
from tests.support.stub_backend import probe_answer

__all__ = ["SGLANG_STUB", "SglangStubState", "adapter_text", "build_sglang_stub", "run_sglang_stub"]

_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@dataclass
class SglangStubState:
    base: str = "base"
    base_root: str = "base"  # SGLang lists the served model name as the base's root
    adapters: dict[str, str] = field(default_factory=dict)
    list_adapters: bool = True
    received: list[dict[str, Any]] = field(default_factory=list)
    loads: list[dict[str, Any]] = field(default_factory=list)
    fail_loads: str | None = None
    busy: bool = False
    flushes: int = 0
    unloads: list[str] = field(default_factory=list)  # names unloaded, in order
    weights: int = 0  # the base's "weights": what the base answers follows them
    probes: list[dict[str, Any]] = field(default_factory=list)  # kvgate's base-fingerprint probe bodies
    contents: dict[str, str] = field(default_factory=dict)  # adapter name -> digest of its bytes at load
    radix: set[tuple[str, str, str]] = field(default_factory=set)  # (cache key, load id, prompt) cached
    load_ids: dict[str, str] = field(default_factory=dict)  # adapter name -> its load's id (a fresh one each)


SGLANG_STUB = web.AppKey("sglang_stub", SglangStubState)


def _update(state: SglangStubState, error: str | None, *, with_adapters: bool = True) -> web.Response:
    answer = {
        "success": error is None,
        "error_message": error or "",
        "loaded_adapters": dict(state.adapters) if with_adapters else None,
    }
    return web.json_response(answer, status=200 if error is None else 400)


async def _models(request: web.Request) -> web.Response:
    state = request.app[SGLANG_STUB]
    data: list[dict[str, Any]] = [
        {"id": state.base, "object": "model", "owned_by": "sglang", "root": state.base_root, "parent": None}
    ]
    if state.list_adapters:
        data += [
            {"id": name, "object": "model", "owned_by": "sglang", "root": path, "parent": state.base}
            for name, path in state.adapters.items()
        ]
    return web.json_response({"object": "list", "data": data})


async def _load(request: web.Request) -> web.Response:
    state = request.app[SGLANG_STUB]
    body = await request.json()
    state.loads.append(body)
    name, path = body["lora_name"], body["lora_path"]
    if state.fail_loads:
        return _update(state, state.fail_loads)
    if name in state.adapters:
        return _update(state, f"Failed to load LoRA adapter {name} because it is already loaded")
    state.adapters[name] = path
    state.contents[name] = _content(path)
    state.load_ids[name] = f"{name}#{next(_LOAD_IDS)}"
    return _update(state, None)


async def _unload(request: web.Request) -> web.Response:
    state = request.app[SGLANG_STUB]
    name = (await request.json())["lora_name"]
    if state.adapters.pop(name, None) is None:
        loaded = f"dict_keys({list(state.adapters)!r})"
        return _update(
            state, f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}", with_adapters=False
        )
    state.unloads.append(name)
    state.contents.pop(name, None)
    state.load_ids.pop(name, None)
    return _update(state, None)


async def _flush(request: web.Request) -> web.Response:
    state = request.app[SGLANG_STUB]
    if state.busy:
        return web.Response(text=_FLUSH_TEXT, status=400)
    state.flushes += 1
    state.radix.clear()
    return web.Response(text=_FLUSH_TEXT)


async def _complete(request: web.Request) -> web.StreamResponse:
    state = request.app[SGLANG_STUB]
    body = await request.json()
    model = body["model"]
    if model == state.base and body.get("prompt") == list(PROBE_PROMPTS):
        state.probes.append(body)
        return web.json_response(probe_answer(state.weights))  # as vLLM: a choice per prompt, top logprobs
    state.received.append(body)
    if model != state.base and model not in state.adapters:
        error = {"object": "error", "message": f"LoRA adapter {model} is not loaded", "type": "BadRequest"}
        return web.json_response(error | {"code": 400}, status=400)
    chat = request.path.endswith("chat/completions")
    kind = "chat.completion" if chat else "text_completion"
    prompt = json.dumps(body.get("messages")) if chat else str(body.get("prompt", ""))
    if model == state.base:
        what = f"base-w{state.weights}"
    else:  # an adapter given at start (``adapters``) has the bytes its path holds now
        what = state.contents.setdefault(model, _content(state.adapters[model]))
    text, logprobs = _answer(what, prompt, int(body.get("max_tokens") or 8))
    if not body.get("stream"):
        tokens = len(prompt.split())
        key = (str(body.get("cache_salt") or "") + str(body.get("extra_key") or ""),
               state.load_ids.get(model, model), prompt)  # fmt: skip
        cached = tokens if key in state.radix else 0
        state.radix.add(key)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if body.get("logprobs") and not chat:
            choice["logprobs"] = {"token_logprobs": logprobs}
        usage = {"prompt_tokens": tokens, "completion_tokens": len(logprobs), "total_tokens": tokens
                 + len(logprobs), "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        return web.json_response(
            {"id": "cmpl-1", "object": kind, "model": model, "choices": [choice], "usage": usage}
        )
    delta = {"delta": {"content": text}} if chat else {"text": text}
    choices = [{"index": 0, **delta, "finish_reason": "length"}]
    chunk = {"id": "cmpl-1", "object": f"{kind}.chunk" if chat else kind, "model": model, "choices": choices}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


_LOAD_IDS = itertools.count()


def _content(path: str) -> str:
    """A digest of the files under ``path`` as they are now (the path itself when it is no directory)."""
    root = Path(path)
    if not root.is_dir():
        return hashlib.sha256(path.encode()).hexdigest()
    tree = hashlib.sha256()
    for file in sorted(f for f in root.rglob("*") if f.is_file()):
        tree.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return tree.hexdigest()


def adapter_text(adapter_dir: Path) -> str:
    """The text every completion of the adapter whose files are at ``adapter_dir`` answers with."""
    return _answer(_content(str(adapter_dir)), "", 1)[0]


def _answer(what: str, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    """The greedy answer of model ``what`` to ``prompt``: a text and one logprob per token."""
    seed = hashlib.sha256(f"{what}\0{prompt}".encode()).digest()
    tokens = max(1, min(max_tokens, 16))
    return f" {what[:12]}", [-0.05 - seed[i] / 256 for i in range(tokens)]


def build_sglang_stub(state: SglangStubState) -> web.Application:
    app = web.Application()
    app[SGLANG_STUB] = state
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/load_lora_adapter", _load)
    app.router.add_post("/unload_lora_adapter", _unload)
    app.router.add_route("GET", "/flush_cache", _flush)
    app.router.add_route("POST", "/flush_cache", _flush)
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    return app


@asynccontextmanager
async def run_sglang_stub(state: SglangStubState, port: int | None = None) -> AsyncIterator[str]:
    """Serve a stub for ``state`` on 127.0.0.1 and yield its base URL."""
    async with running(build_sglang_stub(state), port=port) as url:
        yield url
