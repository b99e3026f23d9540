"""A request body, read once: parsed with a depth limit, checked, and made ready to forward.

Everything here costs in proportion to the body and nothing else does, so the proxy runs it in a
separate process for large bodies (``request.body_lane``), which hands back a ``bounded`` body: the event
loop never parses, renders or serializes a 4 MB prompt, nor holds its objects. Going up, ``forwarded``
only copies bytes: where ``model``'s value sits in the client's bytes (``splice``), or the body already
serialized without the gateway's members (``rest``), is found here, at decode.
``orjson`` parses (it refuses nesting deeper than 1,024 levels and invalid UTF-8 with a ValueError, where
the standard library's parser recursed until RecursionError). Going up, the client's bytes are spliced,
not serialized again: ``model``'s value is replaced in place and the gateway's own members appended
(``forwarded``); only a body where that cannot be exact (the client sent a cache namespace field, or
``model`` is not spelled once literally) is serialized, once, without the members the gateway owns.
orjson writes at most 254 levels, so a body nested deeper is refused here, whether or not it would
need rewriting: one limit for every request (checked by serializing only a body with that many
``{``/``[`` bytes). The prompt is rendered for prefix keys by the request path, only as far as they reach
(``prefix.prompt_text``), and only when they can decide anything.

``stream`` is read the way vLLM's request models read it (``stream: bool | None``, pydantic's lax mode):
``"true"``, ``1`` or ``"yes"`` stream, ``null`` does not, and what vLLM would refuse is a 400 here.
Integers beyond 64 bits are read as floats (orjson's rule), and forwarded as sent (as floats where the
body is serialized); vLLM refuses such values in every integer field anyway. A ``prompt`` given as token
ids (vLLM's ``list[int]`` or ``list[list[int]]``) is checked here: an id that is negative or 2^63 or more
is a 400 (vLLM refuses it as out of vocabulary too, but kvgate keys a prompt's tokens as 64-bit ints
before any replica sees it: ``kv.index``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from gateway.core.errors import BadRequest
from gateway.core.model import TOKEN_ID_END, is_token_id
from gateway.core.prefix import PREFIX_CHARS, content_keys, prompt_text
from gateway.core.wire import CLIENT_NAMESPACE_FIELDS

_STREAM: TypeAdapter[bool | None] = TypeAdapter(bool | None)  # vLLM: ``stream: bool | None = False``
_OWNED = frozenset(("model", *CLIENT_NAMESPACE_FIELDS))


@dataclass(frozen=True, slots=True)
class Body:
    doc: dict[str, Any]  # the whole document, or ``bounded``'s (then ``head_keys`` is set)
    model: str
    stream: bool
    namespaced: bool  # the client sent a cache namespace field (it is never forwarded)
    raw: bytes  # the body as the client sent it
    skip: frozenset[str]  # the members the gateway owns on this route (never forwarded as sent)
    owned_sent: bool  # the client sent one of them besides ``model``
    splice: tuple[int, int, int] | None = None  # ``model``'s value in ``raw`` (at, length) and its end
    rest: bytes | None = None  # else: the body serialized without the members in ``skip``
    head_keys: tuple[bytes, ...] | None = None  # a bounded ``doc``: the whole prompt's ``content_keys``


BOUNDED_MEMBER = 16 * 1024
"""A top-level member (other than ``prompt`` and ``messages``) serialized over this many bytes is left out
of a ``bounded`` document: the request path reads no such member (the whole body goes upstream)."""
_NESTING_SAFE = 254  # fewer '{' and '[' bytes than this: the body cannot be nested deeper than orjson writes
_SPACE = b" \t\r\n"
_ESCAPED_LETTER = re.compile(rb"\\u006[45cdfCDF]")  # a \u escape of d, e, l, m or o: could spell "model"


def decode(raw: bytes, *, model_optional: bool = False, owned: frozenset[str] = frozenset()) -> Body:
    """Parse and check a request body; every refusal is a ``BadRequest`` that says why.

    ``model_optional``: the route's vLLM request model has ``model: str | None`` (no model, or null, is
    the base model: ``model`` is then ""). ``owned``: more members the gateway owns on this route (they
    are never forwarded as the client sent them, like ``model``, e.g. ``request_id`` on ``/v1/responses``)."""
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
    check_token_ids(doc.get("prompt"))
    skip = _OWNED | owned
    rest = None
    if raw.count(b"{") + raw.count(b"[") >= _NESTING_SAFE:  # maybe that deep: the one limit for every body
        rest = _without(doc, skip)
    namespaced = any(field in doc for field in CLIENT_NAMESPACE_FIELDS)
    owned_sent = namespaced or any(key in doc for key in owned)
    splice = None if owned_sent else _splice_point(raw, doc)
    if splice is None and rest is None:
        rest = _without(doc, skip)
    return Body(doc, model, stream, namespaced, raw, skip, owned_sent, splice, rest)


def bounded(body: Body) -> Body:
    """``body`` with what grows with it cut to what the request path reads from it, and without its
    bytes (the caller has them): the request path can take it from another process for the cost of
    its bounded size. Its ``doc`` keeps every top-level member but a big one (serialized over
    ``BOUNDED_MEMBER`` bytes), ``prompt`` and ``messages``: a ``prompt`` string cut to ``PREFIX_CHARS``
    characters, a list of them (or of token ids) and ``messages`` to the items that show in the
    prompt's first ``PREFIX_CHARS`` characters as prefix keys see them (``prompt_text``), whose
    ``content_keys`` it carries (``head_keys``: the costly part of the prefix keys, computed here).
    Everything the request path computes from it equals what it computes from the whole ``body``:
    the prefix keys (``head_keys``), the split key and the follow-up id (top-level scalars, the
    leading messages), the forwarded bytes (``splice`` or ``rest``); the tokens of a large body are computed
    where it is parsed (``request.body_lane``)."""
    doc = body.doc
    head = prompt_text(doc, PREFIX_CHARS)
    small: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "prompt" and isinstance(value, str):
            small[key] = value[:PREFIX_CHARS]
        elif key in ("prompt", "messages") and isinstance(value, list):
            small[key] = _leading(value, len(head))
        elif not isinstance(value, dict | list | str) or len(orjson.dumps(value)) <= BOUNDED_MEMBER:
            small[key] = value
    return replace(body, doc=small, raw=b"", head_keys=tuple(content_keys(head)))


def _leading(items: list[Any], chars: int) -> list[Any]:
    """The items whose rendering begins within the first ``chars`` characters of the list's."""
    shown, size = [], 1
    for item in items:
        if size >= chars:
            break
        shown.append(item)
        size += len(orjson.dumps(item)) + 1
    return shown


def check_token_ids(prompt: object) -> None:
    """A ``BadRequest`` when ``prompt`` holds token ids (ints, in a list or in lists in a list) that are
    not ids: negative, or beyond what kvgate keys (2^63 and more). A list of numbers is bounded by
    ``min`` and ``max`` (C speed: a 4 MiB prompt is a million ids); only one out of bounds is walked."""
    if not isinstance(prompt, list):
        return
    rows = prompt if any(isinstance(item, list) for item in prompt[:1]) else [prompt]
    for row in rows:
        if not isinstance(row, list) or not row:
            continue
        try:
            if min(row) >= 0 and max(row) < TOKEN_ID_END:
                continue
        except TypeError:  # not all numbers: walk it
            pass
        for value in row:
            if type(value) is int and not is_token_id(value):
                raise BadRequest(
                    f"prompt: token id {value} is out of range (token ids are 0 to {TOKEN_ID_END - 1})",
                    param="prompt",
                )


def _without(doc: dict[str, Any], skip: frozenset[str]) -> bytes:
    """``doc`` without the members in ``skip``, serialized (a ``BadRequest`` if nested too deeply)."""
    try:
        return orjson.dumps({key: value for key, value in doc.items() if key not in skip})
    except orjson.JSONEncodeError as exc:  # orjson writes at most 254 levels of nesting
        raise BadRequest(f"request body is nested too deeply to forward ({exc})") from exc


def forwarded(body: Body, owned: dict[str, str]) -> bytes:
    """The body a replica gets: ``owned`` (the gateway's members) in it, none of the client's owned
    members. The client's bytes with ``model``'s value replaced in place where ``decode`` found that
    exact (``splice``), else the body serialized once without the owned members (``rest``) and
    ``owned`` spliced in. Only bytes are copied here, whatever the body's size."""
    if body.splice is None or "model" not in owned:
        rest = body.rest if body.rest is not None else _without(body.doc, body.skip)
        return splice(rest, owned)
    at, length, end = body.splice
    others = {key: text for key, text in owned.items() if key != "model"}
    tail = b"," + orjson.dumps(others)[1:] if others else b"}"
    raw = memoryview(body.raw)
    return b"".join((raw[:at], orjson.dumps(owned["model"]), raw[at + length : end - 1], tail))


def _splice_point(raw: bytes, doc: dict[str, Any]) -> tuple[int, int, int] | None:
    """Where the value of the body's one top-level ``model`` member is in ``raw`` (its offset and
    length) and where the object ends, or None when replacing it in place cannot be exact: no string
    ``model``, or ``"model"`` spelled other than once literally (a ``\\u`` escape of one of its letters
    could spell a key ``model`` that a byte search would not see, and a second ``"model"`` could be a
    nested key or a value). Without such escapes, the one literal ``"model"`` in a body whose top level
    has that member is its key; its value must then be exactly what orjson writes for it."""
    if not isinstance(doc.get("model"), str) or _ESCAPED_LETTER.search(raw):
        return None
    at = raw.find(b'"model"')
    if at < 0 or raw.find(b'"model"', at + 7) >= 0:
        return None
    value = len(raw) - len(raw[at + 7 :].lstrip(_SPACE))
    if raw[value : value + 1] != b":":
        return None
    value = len(raw) - len(raw[value + 1 :].lstrip(_SPACE))
    old = orjson.dumps(doc["model"])
    end = len(raw.rstrip(_SPACE))
    if not raw.startswith(old, value) or raw[end - 1 : end] != b"}":
        return None
    return value, len(old), end


def stream_flag(value: object) -> bool:
    """``stream`` read as vLLM reads it (a JSON member, a form field or a query parameter)."""
    if value is None or value is False or value is True:
        return value is True  # JSON's own literals, read before pydantic is asked
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
    return b"".join((memoryview(rest)[:-1], b",", members[1:]))  # one copy of ``rest``, not two
