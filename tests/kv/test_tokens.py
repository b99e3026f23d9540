"""What the gateway tokenizes, and what it leaves to the predicted index with a reason (a tokenizer
trained here; the real fixture model's tokens, with a template per rendering feature, are checked against
vLLM's /tokenize in tests/vllm/test_precise_vllm.py and tests/vllm/test_render_vllm.py)."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gateway.kv.prompt_tokens import CUT_MARGIN, MAX_CHARS, PromptTokens, Unrendered, Whole
from tests.support.tiny_tokenizer import write_tiny_model


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path)


def test_completions_get_special_tokens_and_chat_is_rendered_without_adding_them(model_dir: Path) -> None:
    tokens = PromptTokens.from_path(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = raw.token_to_id("<|bos|>")
    completion = tokens.completion({"prompt": "the lazy dog"})
    assert not isinstance(completion, Unrendered)
    assert completion[0] == bos
    assert list(completion) == raw.encode("the lazy dog").ids
    assert tokens.completion({"prompt": [5, 6, 7]}) == array("q", [5, 6, 7])  # token ids pass as they are
    assert tokens.completion({"prompt": ["the lazy dog"]}) == completion  # a batch of one
    chat = tokens.chat({"messages": [{"role": "user", "content": "the fox"}]})
    rendered = "<|bos|><|user|>\nthe fox\n<|assistant|>\n"
    assert chat == array("q", raw.encode(rendered, add_special_tokens=False).ids)
    assert not isinstance(chat, Unrendered)
    assert chat.count(bos) == 1  # the template's, not a second one from the post-processor
    assert PromptTokens.from_path(model_dir / "tokenizer.json").chat(
        {"messages": [{"role": "user", "content": "x"}]}
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": ["two", "prompts"]}, "prompt"),
        ({"prompt": {"not": "a prompt"}}, "prompt"),
        ({"prompt": "x", "truncate_prompt_tokens": 5}, "truncated"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "media-part",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"},
            "request-template",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
            "chat-template-kwargs",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "flags"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "not a list"}, "tools"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_kvgate_cannot_reproduce_exactly_is_unrendered_with_a_reason(
    model_dir: Path, body: dict[str, object], reason: str
) -> None:
    tokens = PromptTokens.from_path(model_dir)
    result = tokens.chat(body) if "messages" in body else tokens.completion(body)
    assert result == Unrendered(reason)
    assert not result, "falsy like an empty token list"


def test_a_template_that_fails_on_a_request_is_unrendered(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("{{ raise_exception('no ' + messages[0].role) }}")
    assert PromptTokens.from_path(model_dir).chat(
        {"messages": [{"role": "user", "content": "x"}]}
    ) == Unrendered("template-error")


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({"chat_template.jinja": "{% for %}"}, "template-syntax"),
        ({"preprocessor_config.json": "{}"}, "processor-template"),
    ],
)
def test_a_model_whose_chat_kvgate_cannot_render_starts_and_says_why(
    model_dir: Path, files: dict[str, str], reason: str
) -> None:
    for name, text in files.items():
        (model_dir / name).write_text(text)
    tokens = PromptTokens.from_path(model_dir)
    assert tokens.chat({"messages": [{"role": "user", "content": "x"}]}) == Unrendered(reason)
    assert not isinstance(tokens.completion({"prompt": "the fox"}), Unrendered), "completions still keyed"


def test_template_files_win_over_the_config_and_tools_pick_tool_use(model_dir: Path) -> None:
    (model_dir / "chat_template.jinja").write_text("D:{{ messages[0].content }}")
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text("T:{{ tools | length }}")
    tokens = PromptTokens.from_path(model_dir)
    body: dict[str, object] = {"messages": [{"role": "user", "content": "the fox"}]}
    assert tokens.render(body) == ("D:the fox", False)
    assert tokens.render({**body, "tools": [{"type": "function", "function": {"name": "f"}}]}) == (
        "T:1",
        False,
    )


def test_special_tokens_come_from_the_config_then_the_legacy_map(model_dir: Path) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "image_token": "<img>"}))
    (model_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|eos|>"}}))
    assert PromptTokens.from_path(model_dir).special == {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "image_token": "<img>",
    }


def test_a_long_prompt_is_cut_and_the_tokens_near_the_cut_dropped(model_dir: Path) -> None:
    tokens = PromptTokens.from_path(model_dir)
    text = "the quick brown fox " * (MAX_CHARS // 10)
    cut = tokens.completion({"prompt": text})
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    assert not isinstance(cut, Unrendered)
    assert list(cut) == whole[: len(cut)]
    assert len(cut) < len(whole) - CUT_MARGIN


def test_only_a_whole_text_tokenized_here_is_whole(model_dir: Path) -> None:
    """What the live check compares with the replica's count (``kv.live_check``): not a cut prompt, not
    token ids a client sent."""
    tokens = PromptTokens.from_path(model_dir)
    assert isinstance(tokens.completion({"prompt": "a short prompt"}), Whole)
    assert isinstance(tokens.chat({"messages": [{"role": "user", "content": "hi"}]}), Whole)
    assert not isinstance(tokens.completion({"prompt": "x " * MAX_CHARS}), Whole)
    ids = tokens.completion({"prompt": [5, 6, 7]})
    assert ids == array("q", [5, 6, 7])
    assert not isinstance(ids, Whole)
