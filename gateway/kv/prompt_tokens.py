"""A request's prompt tokenized in the gateway, as the replica will tokenize it (precise prefix keys).

The base model's own ``tokenizer.json`` (the ``tokenizers`` library) and, for chat, its chat template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``), rendered the way vLLM renders it
through transformers: a sandboxed jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the special
tokens of ``tokenizer_config.json`` as variables, ``add_generation_prompt`` (default true); the rendered
text is then tokenized without special tokens (the template writes them), a completion prompt with them.

Only what kvgate can reproduce exactly is tokenized: a string (or token-id) completion prompt, and chat
messages whose contents are strings, with no tools, no custom template and no template arguments. Any
other request gives None: the predicted index routes it. A prompt longer than ``MAX_CHARS`` is cut, and
the tokens near the cut (``CUT_MARGIN``) dropped: keys need only the leading full blocks, and the
tokenizer holds the GIL (``tokenizers`` encodes one text without releasing it), so the cut bounds how
long one request holds the event loop (``loadtest/precise_index.py`` measures it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"  # the routes tokenized
MAX_CHARS = 32 * 1024  # bounds the work per request: tokenizing holds the event loop (about 10 ms here)
CUT_MARGIN = 64
_CHAT_FIELDS_CHANGING_RENDER = (
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "documents",
)
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


class PromptTokens:
    """The base model's tokenizer (and chat template, when it has one)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, special: Mapping[str, str]) -> None:
        self.tokenizer = tokenizer
        self.special = dict(special)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None

    @classmethod
    def from_path(cls, path: Path) -> PromptTokens:
        """From a model directory (``tokenizer.json`` and, if there, its config and chat template) or
        from a ``tokenizer.json`` itself. Raises ``OSError`` / ``ValueError`` when it cannot be read."""
        directory = path if path.is_dir() else path.parent
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        if template is None and isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        special = {name: _token_text(config.get(name)) for name in _SPECIAL}
        return cls(tokenizer, template, {k: v for k, v in special.items() if v is not None})

    def completion(self, body: Mapping[str, Any]) -> tuple[int, ...] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return tuple(prompt)
        if not isinstance(prompt, str) or body.get("add_special_tokens", True) is not True:
            return None
        return self._encode(prompt, special=True)

    def chat(self, body: Mapping[str, Any]) -> tuple[int, ...] | None:
        messages = body.get("messages")
        if self.template is None or not isinstance(messages, list) or not messages:
            return None
        if any(body.get(name) for name in _CHAT_FIELDS_CHANGING_RENDER):
            return None
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            return None
        add_generation_prompt = body.get("add_generation_prompt", True)
        if body.get("add_special_tokens", False) is not False or not isinstance(add_generation_prompt, bool):
            return None
        try:
            text = self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            )
        except jinja2.TemplateError:
            return None  # vLLM answers this request with an error of its own
        return self._encode(text, special=False)

    def _encode(self, text: str, *, special: bool) -> tuple[int, ...]:
        if len(text) <= MAX_CHARS:
            return tuple(self.tokenizer.encode(text, add_special_tokens=special).ids)
        ids = self.tokenizer.encode(text[:MAX_CHARS], add_special_tokens=special).ids
        return tuple(ids[:-CUT_MARGIN])


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # transformers' AddedToken, serialized
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
