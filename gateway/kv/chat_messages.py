"""A chat request's messages, tools and template arguments as vLLM 0.32 hands them to the template.

From ``vllm/renderers/chat_utils.py`` (``_parse_chat_message_content``, ``_postprocess_messages``),
``vllm/renderers/hf.py`` (``safe_apply_chat_template``: developer messages, template arguments) and
the request models (``ChatCompletionRequest.build_chat_params``, ``ChatCompletionToolsParam``):

- content: a string is one text part; parts of type text, input_text, output_text, refusal and
  thinking are text (an empty or missing one dropped). For a ``string`` template the texts are joined
  with newlines; for an ``openai`` one each is ``{"type": "text", "text": ...}`` plus the part's fields
  vLLM does not know. A tool message's text parts become one string either way. A system message's
  leading ``x-anthropic-billing-header`` line is dropped.
- each message is rebuilt: role, content, then tool_calls (an assistant's; arguments parsed from JSON
  to an object, ``{}`` when they are not one), reasoning (twice: ``reasoning`` and
  ``reasoning_content``), tool_call_id (a tool's), name, task; other fields are dropped.
- ``developer`` becomes ``system`` when the template never names the role, and the system messages
  are then merged into the first.
- tools as the request model dumps them: ``{"type": "function", "function": {"name", "description",
  "parameters"[, "strict"][, "defer_loading"]}}``, ``None`` for what is absent.

What kvgate does not reproduce (media parts, part ``uuid``s, a developer message's tools, fields vLLM
would refuse) raises ``Unrenderable`` with a short reason: that request is routed on the predicted index.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.core.errors import Unrenderable
from gateway.kv.chat_template import ChatTemplate

TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
KNOWN_PART_FIELDS = frozenset(  # vllm/renderers/chat_utils.py _KNOWN_CONTENT_PART_FIELDS (vLLM 0.32)
    {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url"}
    | {"input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid"}
    | {"video_embeds", "video_url"}
)
BILLING_HEADER = "x-anthropic-billing-header"
HF_NAMED_ARGUMENTS = frozenset(  # transformers' apply_chat_template parameters (vllm/renderers/hf.py)
    {"add_generation_prompt", "chat_template", "continue_final_message", "conversation", "documents"}
    | {"max_length", "padding", "return_assistant_tokens_mask", "return_dict", "return_tensors", "self"}
    | {"tokenize", "tokenizer_kwargs", "tools", "truncation"}
)


def conversation(messages: object, template: ChatTemplate) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("messages")
    wrap = template.content_format == "openai"
    out = [_message(message, wrap) for message in messages]
    if any(m["role"] == "developer" for m in out) and not template.developer:
        out = _consolidate_system([_as_system(m) if m["role"] == "developer" else m for m in out])
    return out


def _message(message: object, wrap: bool) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Unrenderable("message")
    role, content = message["role"], message.get("content")
    if content is None:
        parts: list[object] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise Unrenderable("content")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = [text for text in (_part(part, wrap) for part in parts) if text]
    out: dict[str, Any] = {"role": role, "content": texts if wrap else "\n".join(texts)}  # type: ignore[arg-type]
    if role == "assistant":
        calls = _tool_calls(message.get("tool_calls"))
        if calls:  # vLLM drops an empty list (the template takes the plain assistant path)
            out["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise Unrenderable("reasoning")
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if wrap:
            out["content"] = "\n".join(part["text"] for part in texts)  # type: ignore[index]
    for name in ("name", "task"):
        if isinstance(message.get(name), str):
            out[name] = message[name]
    if role == "developer":
        if message.get("tools") is not None:
            raise Unrenderable("developer-tools")
        out["tools"] = None
    return out


def _part(part: object, wrap: bool) -> object:
    """One content part: its text (a string, or the wrapped dict), None when vLLM drops it."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, dict) or part.get("uuid") is not None:
        raise Unrenderable("content-part")
    kind = part.get("type")
    key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None:
        raise Unrenderable("media-part")
    text = part.get(key)
    if text is None and kind in ("text", "refusal"):
        return None  # vLLM skips these (PART_TYPES_TO_SKIP_NONE_CONTENT)
    if not isinstance(text, str):
        raise Unrenderable("content-part")
    if not wrap:
        return text
    return {"type": "text", "text": text, **{k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}}


def _strip_billing_header(parts: list[object]) -> list[object]:
    out: list[object] = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, dict) and _is_text(part)
            else None
        )
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})  # type: ignore[dict-item]
    return out


def _is_text(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"


def _tool_calls(calls: object) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise Unrenderable("tool-calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or set(call) - {"id", "type", "function"}
            or not isinstance(call.get("id"), str)
            or call.get("type") != "function"
            or not isinstance(function, dict)
            or set(function) - {"name", "arguments"}
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise Unrenderable("tool-calls")
        # the order pydantic validates them in: id, function (arguments, name), type
        arguments = {"arguments": _arguments(function["arguments"]), "name": function["name"]}
        out.append({"id": call["id"], "function": arguments, "type": "function"})
    return out


def _arguments(text: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text) if text else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    out = {**message, "role": "system"}
    out.pop("tools", None)
    return out


def _consolidate_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, message in enumerate(messages):
        if message["role"] != "system":
            others.append(message)
            continue
        needed = needed or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if (isinstance(p, dict) and "text" in p) or isinstance(p, str)
            )
        if content:
            systems.append(content)
    if not needed:
        return messages
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    given = body.get("tools")
    if given is None:
        return None
    if not isinstance(given, list):
        raise Unrenderable("tools")
    return [_tool(tool) for tool in given]


def _tool(tool: object) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(function, dict)
    ):
        raise Unrenderable("tools")
    fields: dict[str, tuple[type, ...]] = {
        "name": (str,),
        "description": (str, type(None)),
        "parameters": (dict, type(None)),
        "strict": (bool, type(None)),
        "defer_loading": (bool, type(None)),
    }
    if not isinstance(function.get("name"), str) or any(
        not isinstance(function.get(k), kinds) for k, kinds in fields.items()
    ):
        raise Unrenderable("tools")
    defer = tool.get("defer_loading")
    if not isinstance(defer, (bool, type(None))):
        raise Unrenderable("tools")
    dumped = {k: function.get(k) for k in ("name", "description", "parameters")}
    if function.get("strict") is not None:
        dumped["strict"] = function["strict"]
    function_defer = function.get("defer_loading")
    if function_defer is not None or defer is not None:  # the tool's own is carried into its function
        dumped["defer_loading"] = function_defer if function_defer is not None else defer
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def template_arguments(body: Mapping[str, Any], template: ChatTemplate) -> dict[str, Any]:
    """The template's variables besides messages and tools (``ChatCompletionRequest.build_chat_params``,
    vLLM's ``merge_kwargs`` dropping None and "auto", ``resolve_chat_template_kwargs`` keeping what the
    template reads, transformers' ``apply_chat_template`` taking its named arguments out)."""
    given = body.get("chat_template_kwargs") or {}
    if not isinstance(given, dict):
        raise Unrenderable("chat-template-kwargs")
    extra = {k: v for k, v in given.items() if v is not None and v != "auto"}
    if set(extra) & (HF_NAMED_ARGUMENTS | {"messages"}):
        raise Unrenderable("chat-template-kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and effort != "auto":
        extra["reasoning_effort"] = effort
        if "enable_thinking" not in given:
            extra["enable_thinking"] = effort != "none"
    arguments = {k: v for k, v in extra.items() if k in template.variables}
    documents = body.get("documents")
    arguments["documents"] = None if documents == "auto" else documents
    return arguments
