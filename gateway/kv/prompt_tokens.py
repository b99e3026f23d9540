"""A request's prompt tokenized in the gateway, as the replica will tokenize it (precise prefix keys).

The base model's own ``tokenizer.json`` (the ``tokenizers`` library) and, for chat, its chat template,
read from the directory as transformers 5 reads it (``chat_template.jinja`` and
``additional_chat_templates/*.jinja``, else ``tokenizer_config.json``'s ``chat_template``, a string or
named templates) and rendered as vLLM 0.32 renders it through transformers: the template compiled like
transformers' (``chat_template.py``), the messages, tools and template arguments as vLLM passes them
(``chat_messages.py``), the named special tokens (``bos_token`` ... and any ``*_token`` of the config) as
variables, ``add_generation_prompt`` (default true) and ``continue_final_message`` as transformers
applies them; the text is then tokenized without special tokens unless the request asks for them
(the template writes them), a completion prompt with them.

What kvgate cannot render exactly gives ``Unrendered`` with a short reason (the request path counts it
in ``kvgate_prompt_unrendered_total{reason}`` and the predicted index routes that request): media
parts, a chat template sent with the request (vLLM refuses one unless started with
``--trust-request-chat-template``), ``truncate_prompt_tokens``, a model directory with a processor
(vLLM may take the processor's template), a template that does not compile or fails on this request.
kvgate assumes the replicas render with their model's own template and defaults (no ``--chat-template``,
``--chat-template-content-format`` or ``--default-chat-template-kwargs``) and share its clock and time
zone (``strftime_now``).

A prompt longer than ``MAX_CHARS`` is cut, and the tokens near the cut (``CUT_MARGIN``) dropped: keys
need only the leading full blocks, and the tokenizer holds the GIL (``tokenizers`` encodes one text
without releasing it), so the cut bounds how long one request holds it (``loadtest/precise_index.py``
measures it). For the same reason a chat template is rendered only until its text passes ``MAX_CHARS``
(jinja renders in order, so that is the start of the whole text; a failure of the template further on
is then vLLM's 400, not seen here), and of a prompt given as token ids only the first ``MAX_TOKENS``
are walked. A large body is tokenized where it is parsed, in the body lane (``request.body_lane``),
when the tokenizer of ``base_model`` is known at start. The tokens of a prompt tokenized whole are
``Whole``: the live check (``kv.live_check``) compares their count with the replica's
``usage.prompt_tokens``.

Tokens are int64 arrays (``array('q')``): a large body's go back from the body lane as one block of
bytes (unpickling 32,768 ids as a tuple of ints held the serving loop 0.7 ms, as an array 0.2 ms) and are
keyed from it without a copy per id (``kv.index.block_keys``).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
from tokenizers import Tokenizer

from gateway.core.errors import Unrenderable
from gateway.kv.chat_messages import conversation, template_arguments, tools
from gateway.kv.chat_template import ChatTemplate

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"  # the routes tokenized
MAX_CHARS = 32 * 1024  # bounds the work per request: tokenizing holds the GIL (about 10 ms here)
MAX_TOKENS = MAX_CHARS  # of a prompt given as token ids, only so many are keyed (a text's are fewer)
CUT_MARGIN = 64
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' render_jinja_template


def of_route(tokens: PromptTokens, path: str, body: Mapping[str, Any]) -> Tokens | None:
    """The prompt's tokens on a route kvgate tokenizes (``COMPLETIONS``, ``CHAT_COMPLETIONS``), else None."""
    if path == COMPLETIONS:
        return tokens.completion(body)
    if path == CHAT_COMPLETIONS:
        return tokens.chat(body)
    return None


@dataclass(frozen=True)
class Unrendered:
    """A prompt kvgate does not tokenize exactly: why, as a short label (a metric's value)."""

    reason: str

    def __bool__(self) -> Literal[False]:
        """Falsy like an empty token list: ``tokens.completion(body) or ()`` reads as "no tokens"."""
        return False


if TYPE_CHECKING:
    Ids = array[int]
else:
    Ids = array  # not subscriptable at run time before Python 3.12


def ids(values: list[int]) -> Ids:
    """Token ids as kvgate holds them: int64 (``core.body.check_token_ids`` bounds a client's)."""
    return array("q", values)


class Whole(Ids):
    """The tokens of a whole prompt text, tokenized here (not cut at ``MAX_CHARS``, not token ids a client
    sent): the replica's ``usage.prompt_tokens`` for it must be their count (``kv.live_check``)."""

    __slots__ = ()


Tokens = Ids | Unrendered
"""A prompt's leading tokens (at most ``MAX_TOKENS``; a text's cut near ``MAX_CHARS``), or why none."""


class PromptTokens:
    """The base model's tokenizer and its chat templates (by name: ``default``, ``tool_use``, ...)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, ChatTemplate],
        special: Mapping[str, str],
        chat_problem: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.templates = dict(templates)
        self.special = dict(special)
        self.chat_problem = chat_problem
        """Why no chat request of this model can be rendered exactly, when none can."""

    @property
    def template(self) -> ChatTemplate | None:
        return self.templates.get("default")

    @classmethod
    def from_path(cls, path: Path) -> PromptTokens:
        """From a model directory (``tokenizer.json`` and, if there, its config and chat templates) or
        from a ``tokenizer.json`` itself. Raises ``OSError`` / ``ValueError`` when it cannot be read."""
        directory = path if path.is_dir() else path.parent
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        config = _json(directory / "tokenizer_config.json")
        sources = _template_sources(directory, config)
        templates: dict[str, ChatTemplate] = {}
        problem = None
        for name, source in sources.items():
            try:
                templates[name] = ChatTemplate(source)
            except jinja2.TemplateError:
                problem = "template-syntax"  # vLLM fails every chat request of this template too
        if not sources:
            problem = "no-template"
        elif len(sources) > 1 and "default" not in sources:
            problem = "no-default-template"
        if any((directory / name).is_file() for name in PROCESSOR_FILES):
            problem = "processor-template"
        return cls(tokenizer, templates, _special_tokens(directory, config), problem)

    def completion(self, body: Mapping[str, Any]) -> Tokens:
        if body.get("prompt_embeds") is not None:
            return Unrendered("prompt-embeds")
        if body.get("truncate_prompt_tokens") is not None:
            return Unrendered("truncated")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
            leading = prompt[:MAX_TOKENS]  # keys need only the leading blocks: the rest is never walked
            if all(type(t) is int for t in leading):
                return ids(leading)
            return Unrendered("prompt")
        special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            return Unrendered("prompt")
        return self._encode(prompt, special=special)

    def chat(self, body: Mapping[str, Any]) -> Tokens:
        try:
            text, special = self.render(body)
        except Unrenderable as exc:
            return Unrendered(str(exc))
        return self._encode(text, special=special)

    def render(self, body: Mapping[str, Any]) -> tuple[str, bool]:
        """The chat request's prompt text as vLLM renders it, and whether special tokens are added
        when it is tokenized. Raises ``Unrenderable``."""
        if self.chat_problem is not None:
            raise Unrenderable(self.chat_problem)
        if body.get("chat_template") is not None:
            raise Unrenderable("request-template")
        if body.get("truncate_prompt_tokens") is not None:
            raise Unrenderable("truncated")
        generation = body.get("add_generation_prompt", True)
        final = body.get("continue_final_message", False)
        special = body.get("add_special_tokens", False)
        if not all(isinstance(flag, bool) for flag in (generation, final, special)) or (generation and final):
            raise Unrenderable("flags")
        tool_list = tools(body)
        template = self._template(tool_list)
        messages = conversation(body.get("messages"), template)
        arguments = template_arguments(body, template)
        documents = arguments.pop("documents")
        final_text = ""
        if final:
            final_text = _tag_final_message(messages, template)
        try:  # the template's own failure (raise_exception, a type error...): vLLM answers 400
            text = template.render(
                None if final else MAX_CHARS,  # only as far as keys reach (the final message's cut needs all)
                messages=messages,
                tools=tool_list,
                documents=documents,
                add_generation_prompt=generation,
                **{**self.special, **arguments},
            )
        except Exception as exc:  # whatever the template raises, vLLM refuses the request
            raise Unrenderable("template-error") from exc
        return (_cut_at_tag(text, final_text) if final else text), special

    def _template(self, tool_list: list[dict[str, Any]] | None) -> ChatTemplate:
        """transformers' ``get_chat_template``: with tools, ``tool_use`` when there is one."""
        if tool_list is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        template = self.templates.get("default")
        if template is None:
            raise Unrenderable("no-template")
        return template

    def _encode(self, text: str, *, special: bool) -> Ids:
        if len(text) <= MAX_CHARS:
            return Whole("q", self.tokenizer.encode(text, add_special_tokens=special).ids)
        encoded = self.tokenizer.encode(text[:MAX_CHARS], add_special_tokens=special).ids
        return ids(encoded[:-CUT_MARGIN])


def _tag_final_message(messages: list[dict[str, Any]], template: ChatTemplate) -> str:
    """transformers' ``continue_final_message``: the last message's (last text part's) text marked."""
    if "content" not in template.source:
        raise Unrenderable("continue-final-message")
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if "text" in part:
                final: str = part["text"]
                part["text"] = final + CONTINUE_TAG
                return final
        raise Unrenderable("continue-final-message")
    if not isinstance(content, str):
        raise Unrenderable("continue-final-message")
    last["content"] = content + CONTINUE_TAG
    return content


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise Unrenderable("continue-final-message")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


def _template_sources(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """transformers 5's ``from_pretrained``: the .jinja files win over the config's template."""
    sources: dict[str, str] = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        sources["default"] = default.read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            sources[file.stem] = file.read_text(encoding="utf-8")
    if sources:
        return sources
    given = config.get("chat_template")
    if isinstance(given, str):
        return {"default": given}
    if isinstance(given, list):
        return {t["name"]: t["template"] for t in given if isinstance(t, dict)}
    return {}


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens transformers passes to every template (``special_tokens_map``): the
    seven standard names and any other ``*_token`` of the config, else of ``special_tokens_map.json``."""
    legacy = _json(directory / "special_tokens_map.json")
    named = dict.fromkeys(NAMED_SPECIAL)
    named.update(dict.fromkeys(k for k in config if k.endswith("_token")))
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update(dict.fromkeys(extra))
    found = {}
    for name in named:
        value = _token_text(config.get(name))
        if value is None and isinstance(extra, dict):
            value = _token_text(extra.get(name))
        if value is None:
            value = _token_text(legacy.get(name))
        if value is not None:
            found[name] = value
    return found


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # transformers' AddedToken, serialized
        value = value.get("content")
    return value if isinstance(value, str) else None
