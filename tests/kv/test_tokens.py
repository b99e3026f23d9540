"""What the gateway tokenizes, and what it leaves to the predicted index (a tokenizer trained here; the
real fixture model's tokens are checked against vLLM's /tokenize in tests/vllm/test_precise_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from gateway.kv.prompt_tokens import CUT_MARGIN, MAX_CHARS, PromptTokens

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|bos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "chat_template": TEMPLATE})
    )
    return tmp_path


def test_completions_get_special_tokens_and_chat_is_rendered_without_adding_them(model_dir: Path) -> None:
    tokens = PromptTokens.from_path(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = raw.token_to_id("<|bos|>")
    completion = tokens.completion({"prompt": "the lazy dog"})
    assert completion is not None
    assert completion[0] == bos
    assert list(completion) == raw.encode("the lazy dog").ids
    assert tokens.completion({"prompt": [5, 6, 7]}) == (5, 6, 7)  # token ids pass as they are
    assert tokens.completion({"prompt": ["the lazy dog"]}) == completion  # a batch of one
    chat = tokens.chat({"messages": [{"role": "user", "content": "the fox"}]})
    rendered = "<|bos|><|user|>\nthe fox\n<|assistant|>\n"
    assert chat == tuple(raw.encode(rendered, add_special_tokens=False).ids)
    assert chat is not None
    assert chat.count(bos) == 1  # the template's, not a second one from the post-processor
    assert PromptTokens.from_path(model_dir / "tokenizer.json").chat(
        {"messages": [{"role": "user", "content": "x"}]}
    )


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["two", "prompts"]},
        {"prompt": {"not": "a prompt"}},
        {"prompt": "x", "add_special_tokens": False},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": True}},
        {"messages": []},
    ],
)
def test_what_kvgate_cannot_reproduce_exactly_is_left_to_the_predicted_index(
    model_dir: Path, body: dict[str, object]
) -> None:
    tokens = PromptTokens.from_path(model_dir)
    assert (tokens.chat(body) if "messages" in body else tokens.completion(body)) is None


def test_a_long_prompt_is_cut_and_the_tokens_near_the_cut_dropped(model_dir: Path) -> None:
    tokens = PromptTokens.from_path(model_dir)
    text = "the quick brown fox " * (MAX_CHARS // 10)
    cut = tokens.completion({"prompt": text})
    whole = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    assert cut is not None
    assert list(cut) == whole[: len(cut)]
    assert len(cut) < len(whole) - CUT_MARGIN
