"""Every vLLM 0.32 route kvgate passes through, as data: one row per route, its kind and what kvgate owns.

Read from vLLM 0.32's source (``vllm/entrypoints/``; the table with each route's source file is in
``docs/routes.md``). Every row goes through the same stages (caller → parse → resolve → schedule →
forward); the row says how the body carries the model and what kvgate sets in it:

- ``json``: a JSON body with ``model`` (``model_optional``: vLLM's request model has ``model: str | None``,
  so no model is the base model). ``namespaced``: vLLM's request model takes ``cache_salt``, so the
  gateway's cache namespace goes in (a client's is never forwarded). A GET row has no body: the base model.
- ``form``: a multipart/form-data body (audio) whose ``model`` field is rewritten.
- ``response``: a follow-up addressed by a response id in the path (``/v1/responses/{response_id}``):
  it goes to the replica that made and stores that response (``wire.response_replica``), or is refused.
- ``model-card``: ``/v1/models/{model}``; vLLM has no such route, so kvgate answers with the card the
  chosen replica lists for the effective model, under the caller's name for it.

Nothing else reaches a replica: health, metrics, load, version, LoRA loading, profiling, sleep, cache
resets, RPC, RL weight updates, elastic EP, fault tolerance, SageMaker ``/invocations`` (its adapter
header would bypass resolution), ``/abort_requests``, the Cohere chat routes (off by default in vLLM, and
their request takes no ``cache_salt``, so kvgate could not keep tenants' base-model caches apart) and the
realtime websocket are simply not routed (404, OpenAI-style).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RouteKind = Literal["json", "form", "response", "model-card"]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    kind: RouteKind = "json"
    model_optional: bool = False  # no ``model`` (or null) is the base model, as in vLLM's request model
    namespaced: bool = False  # vLLM's request model takes ``cache_salt``: the gateway sets it
    mints_response_id: bool = False  # kvgate sets ``request_id`` (the response id names the replica)
    operation: str = "other"  # the span's gen_ai.operation.name

    @property
    def has_body(self) -> bool:
        return self.method != "GET"


def _generate(
    path: str, operation: str, *, model_optional: bool = True, mints_response_id: bool = False
) -> Route:
    return Route(
        "POST", path, model_optional=model_optional, namespaced=True,
        mints_response_id=mints_response_id, operation=operation,
    )  # fmt: skip


def _pooling(path: str, operation: str, *, model_optional: bool = True) -> Route:
    return Route("POST", path, model_optional=model_optional, namespaced=True, operation=operation)


def _plain(path: str, operation: str, *, model_optional: bool = True) -> Route:
    return Route("POST", path, model_optional=model_optional, operation=operation)


ROUTES: tuple[Route, ...] = (
    # generation (registered when the model supports "generate")
    _generate("/v1/completions", "text_completion"),
    _generate("/v1/chat/completions", "chat"),
    _generate("/v1/chat/completions/batch", "chat"),
    _generate("/v1/responses", "responses", mints_response_id=True),
    Route("GET", "/v1/responses/{response_id}", "response", operation="responses"),
    Route("POST", "/v1/responses/{response_id}/cancel", "response", operation="responses"),
    _generate("/v1/messages", "chat", model_optional=False),
    _plain("/v1/messages/count_tokens", "tokenize", model_optional=False),
    _generate("/generative_scoring", "score"),
    _generate("/v1/systemone", "structured_decisions"),
    _generate("/inference/v1/generate", "generate"),
    # rendering prompts to tokens and back, no generation ("generate" or "render")
    _plain("/v1/completions/render", "render"),
    _plain("/v1/chat/completions/render", "render"),
    _plain("/v1/messages/render", "render", model_optional=False),
    _plain("/v1/responses/render", "render"),
    _plain("/v1/completions/derender", "render"),
    _plain("/v1/chat/completions/derender", "render"),
    # pooling (registered when the model has a pooling task)
    _pooling("/v1/embeddings", "embeddings"),
    _plain("/v2/embed", "embeddings"),
    _pooling("/pooling", "pooling"),
    _pooling("/classify", "classify"),
    _pooling("/score", "score"),
    _pooling("/v1/score", "score"),
    _pooling("/rerank", "rerank"),
    _pooling("/v1/rerank", "rerank"),
    _pooling("/v2/rerank", "rerank"),
    # tokenizer (always registered)
    _plain("/tokenize", "tokenize"),
    _plain("/detokenize", "detokenize"),
    Route("GET", "/tokenizer_info", operation="tokenize"),
    # speech to text (registered when the model supports "transcription"): multipart bodies
    Route("POST", "/v1/audio/transcriptions", "form", model_optional=True, operation="transcription"),
    Route("POST", "/v1/audio/translations", "form", model_optional=True, operation="translation"),
    # models
    Route("GET", "/v1/models/{model:.+}", "model-card", operation="models"),
)
"""Every route kvgate passes through. ``GET /v1/models`` (the listing) is kvgate's own answer."""
