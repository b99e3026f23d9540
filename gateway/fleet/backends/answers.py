"""Every answer kvgate reads from a replica, parsed in one place per kind of answer.

A replica is not trusted to answer in shape: a restart behind a proxy answers 200 ``text/html``, a broken
exporter writes ``process_start_time_seconds NaN``, a hostile one nests ``/v1/models`` 200,000 deep. Each
reader here returns a well-formed value or raises ``MalformedAnswer`` with a short reason, never anything
else (tests/table/test_boundary_properties.py checks it over arbitrary bytes and JSON of any shape). The
callers
mark that replica with the reason (unhealthy, or not fingerprinted) and go on with the others.

- ``json_of``: a body as JSON (strict UTF-8, any nesting kvgate's parser cannot hold is malformed).
- ``reason_of``: a refusal's words, for people (never raises: bytes that are not UTF-8 are replaced).
- ``model_list``: ``/v1/models`` as an ``AdapterListing``.
- ``start_time``: ``process_start_time_seconds`` in ``/metrics`` (None when it is not there).
- ``probe_tops``: the base-fingerprint probe's first-token top logprobs, per prompt.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.core.errors import MalformedAnswer

_START_TIME = re.compile(rb"^process_start_time_seconds(?:\{[^}\n]*\})?[ \t]+(\S+)", re.MULTILINE)
_REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class AdapterListing:
    """One replica's answer to "what do you serve?"."""

    base_name: str | None
    base_root: str | None
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> root path it was loaded from
    max_model_len: int | None = None  # the base's context length, when the server reports it (vLLM does)


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def json_of(body: bytes) -> Any:
    """BODY as JSON; ``MalformedAnswer`` when it is not UTF-8, not JSON, or nested too deep to parse."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedAnswer(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise MalformedAnswer("the JSON is nested too deep") from None
    except ValueError as exc:  # JSONDecodeError, and integers too long to convert
        detail = f"{exc.msg} at {exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)[:80]
        raise MalformedAnswer(f"the body is not JSON ({detail}): {_preview(text)}") from None


def _preview(text: str) -> str:
    flat = " ".join(text[:_REASON_CHARS].split())
    return repr(flat + ("..." if len(text) > _REASON_CHARS else ""))


def reason_of(body: bytes, status: int) -> str:
    """A refusal's reason: OpenAI's ``error.message``, FastAPI's ``detail``/``message``, else the text."""
    try:
        doc = json_of(body)
    except MalformedAnswer:
        doc = None
    if isinstance(doc, dict):
        error = doc.get("error")
        for value in (error.get("message") if isinstance(error, dict) else error, doc.get("message"),
                      doc.get("detail")):  # fmt: skip
            if isinstance(value, str) and value:
                return value
    text = body.decode("utf-8", errors="replace").strip()
    return text[: _REASON_CHARS * 5] or f"HTTP {status}"


def agent_path(doc: Any, digest: str) -> str:
    """A ``kvgate agent``'s answer to a fetch of DIGEST: ``{"digest": DIGEST, "path": "/abs/.../DIGEST"}``."""
    if not isinstance(doc, dict) or doc.get("digest") != digest:
        raise MalformedAnswer(f"the agent's answer is {_kind(doc)}, not the fetch of this digest")
    path = doc.get("path")
    if not isinstance(path, str) or not path.startswith("/") or not path.endswith(f"/{digest}"):
        raise MalformedAnswer("the agent's answer has no absolute path ending in the digest")
    return path


def agent_refusal(body: bytes, status: int) -> str:
    """Why an agent refused a fetch: its ``error.code`` when it is one of its outcomes, else ``refused``."""
    try:
        doc = json_of(body)
    except MalformedAnswer:
        return "refused"
    error = doc.get("error") if isinstance(doc, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code in AGENT_OUTCOMES else f"refused-{status // 100}xx"


AGENT_OUTCOMES = frozenset(
    {"changed", "truncated", "missing", "unreachable", "disk-full", "budget", "bad-manifest", "unauthorized"}
)


def model_list(doc: Any) -> AdapterListing:
    """An OpenAI model list: the first entry without ``parent`` is the base, the rest are adapters.

    Every entry is an object with a string ``id``; ``root`` and ``parent`` are strings or absent (a
    missing ``root`` reads as ``""``: the loader then sees a root that is not in its store). Anything
    else is malformed: kvgate cannot tell what such a replica serves.
    """
    if not isinstance(doc, dict):
        raise MalformedAnswer(f"/v1/models is {_kind(doc)}, not an object")
    models = doc.get("data")
    if not isinstance(models, list):
        raise MalformedAnswer(f"/v1/models 'data' is {_kind(models)}, not a list")
    base_name: str | None = None
    base_root: str | None = None
    max_model_len: int | None = None
    adapters: dict[str, str] = {}
    for index, model in enumerate(models):
        if not isinstance(model, dict):
            raise MalformedAnswer(f"/v1/models entry {index} is {_kind(model)}, not an object")
        name, root, parent = model.get("id"), model.get("root"), model.get("parent")
        if not isinstance(name, str) or not name:
            raise MalformedAnswer(f"/v1/models entry {index} has an 'id' that is {_kind(name)}")
        for what, value in (("root", root), ("parent", parent)):
            if value is not None and not isinstance(value, str):
                raise MalformedAnswer(f"/v1/models entry {name!r} has a '{what}' that is {_kind(value)}")
        if parent:
            adapters[name] = root or ""
        elif base_name is None:
            base_name, base_root = name, root or ""
            context = model.get("max_model_len")
            valid = isinstance(context, int) and not isinstance(context, bool) and context > 0
            max_model_len = context if valid else None
    return AdapterListing(base_name, base_root, adapters, max_model_len)


def start_time(body: bytes) -> float | None:
    """``process_start_time_seconds`` in a Prometheus exposition (None: not there); malformed when its
    value is not a finite number."""
    found = _START_TIME.search(body)
    if found is None:
        return None
    raw = found[1].decode(errors="replace")
    try:
        value = float(raw)
    except ValueError:
        raise MalformedAnswer(f"process_start_time_seconds is {raw[:40]!r}, not a number") from None
    if not math.isfinite(value):
        raise MalformedAnswer(f"process_start_time_seconds is {raw[:40]!r}, not a finite number")
    return value


def probe_tops(doc: Any, prompts: int, k: int) -> list[list[tuple[str, float]]]:
    """The probe's answer (one choice per prompt, ``max_tokens`` 1, ``logprobs`` at least K): per prompt,
    in the prompts' order (``index``), its first position's top K (token, logprob), highest first; finite
    numbers."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if (
        not isinstance(choices, list)
        or len(choices) != prompts
        or not all(isinstance(c, dict) for c in choices)
    ):
        raise MalformedAnswer(f"the probe's answer has no list of {prompts} choice objects")
    found: dict[int, list[tuple[str, float]]] = {}
    for choice in choices:
        index, logprobs = choice.get("index"), choice.get("logprobs")
        tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        first = tops[0] if isinstance(tops, list) and tops else None
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(first, dict):
            raise MalformedAnswer("a probe choice has no index or no top_logprobs[0] object")
        pairs: list[tuple[str, float]] = []
        for token, value in first.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise MalformedAnswer(f"a probe top logprob is {_kind(value)} {str(value)[:40]}")
            pairs.append((token, float(value)))
        if len(pairs) < k:
            raise MalformedAnswer(f"a probe choice has {len(pairs)} top logprobs, not {k}")
        found[index] = sorted(pairs, key=lambda pair: -pair[1])[:k]
    if sorted(found) != list(range(prompts)):
        raise MalformedAnswer(f"the probe's choices are not indexed 0..{prompts - 1}")
    return [found[i] for i in range(prompts)]
