"""A request body, read once: parsed with a depth limit, checked, and made ready to forward.

Everything here costs in proportion to the body and nothing else does, so the proxy runs it in a worker
thread for large bodies and the event loop never parses, renders or serializes a 4 MB prompt itself.
``orjson`` parses (it refuses nesting deeper than 1,024 levels and invalid UTF-8 with a ValueError, where
the standard library's parser recursed until RecursionError) and serializes once: the body minus the
members the gateway owns (``model`` and the client's cache namespace fields), into which ``splice``
later writes the gateway's own members without touching the rest again. orjson writes at most 254
levels, so a body nested deeper is refused here, whether or not it would need rewriting: one limit for
every request. The prompt is rendered for prefix keys only as far as they reach (``prefix.prompt_text``).

``stream`` is read the way vLLM's request models read it (``stream: bool | None``, pydantic's lax mode):
``"true"``, ``1`` or ``"yes"`` stream, ``null`` does not, and what vLLM would refuse is a 400 here.
Integers beyond 64 bits are read as floats (orjson's rule) and forwarded so; vLLM refuses such values in
every integer field anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from gateway.core.errors import BadRequest
from gateway.core.prefix import prompt_text
from gateway.core.wire import CLIENT_NAMESPACE_FIELDS

_STREAM: TypeAdapter[bool | None] = TypeAdapter(bool | None)  # vLLM: ``stream: bool | None = False``
_OWNED = frozenset(("model", *CLIENT_NAMESPACE_FIELDS))


@dataclass(frozen=True, slots=True)
class Body:
    doc: dict[str, Any]
    model: str
    stream: bool
    namespaced: bool  # the client sent a cache namespace field (it is never forwarded)
    rest: bytes  # the body without ``model`` and the client's namespace fields, serialized
    prompt: str  # the start of the prompt as prefix keys see it (``prefix.prompt_text``)


def decode(raw: bytes, *, model_optional: bool = False, owned: frozenset[str] = frozenset()) -> Body:
    """Parse and check a request body; every refusal is a ``BadRequest`` that says why.

    ``model_optional``: the route's vLLM request model has ``model: str | None`` (no model, or null, is
    the base model: ``model`` is then ""). ``owned``: more members the gateway owns on this route (they
    are left out of ``rest`` like ``model``, e.g. ``request_id`` on ``/v1/responses``)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    model = doc.get("model")
    if model is None and model_optional:
        model = ""
    elif not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", param="model")
    stream = stream_flag(doc.get("stream"))
    skip = _OWNED | owned
    try:
        rest = orjson.dumps({key: value for key, value in doc.items() if key not in skip})
    except orjson.JSONEncodeError as exc:  # orjson writes at most 254 levels of nesting
        raise BadRequest(f"request body is nested too deeply to forward ({exc})") from exc
    namespaced = any(field in doc for field in CLIENT_NAMESPACE_FIELDS)
    return Body(doc, model, stream, namespaced, rest, prompt_text(doc))


def stream_flag(value: object) -> bool:
    """``stream`` read as vLLM reads it (a JSON member, a form field or a query parameter)."""
    try:
        return _STREAM.validate_python(value) is True
    except ValidationError as exc:
        raise BadRequest(
            'stream must be a boolean (read as vLLM reads it: true, false, "true", "false", 1, 0, null)',
            param="stream",
        ) from exc


def splice(rest: bytes, owned: dict[str, str]) -> bytes:
    """``rest`` (a serialized JSON object) with the gateway's own members added at its end."""
    members = orjson.dumps(owned)
    if len(members) <= 2:
        return rest
    if len(rest) <= 2:  # b"{}"
        return members
    return rest[:-1] + b"," + members[1:]
