"""Build the tiny, deterministic test fixture: a random Llama, a local tokenizer and three LoRA adapters.

Run with the vLLM virtualenv's python (it needs torch, transformers, tokenizers and peft):

    .venv-vllm/bin/python scripts/build_fixture.py --out .cache/fixture

Layout written (atomically: built in a temporary sibling folder, then renamed into place):

    OUT/model/                 LlamaForCausalLM (bfloat16 safetensors), tokenizer.json & co, chat template
    OUT/adapters/v1, v2, v3/   PEFT LoRA adapters (r=8, q_proj & v_proj), each from its own seed
    OUT/manifest.json          sha256 of every file above

Everything is seeded and nothing is downloaded: the same script gives the same bytes on every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# torch & co live only in the vLLM virtualenv: the project's type checker runs without them.
import torch  # type: ignore[import-not-found, unused-ignore]
from peft import LoraConfig, PeftModel, get_peft_model  # type: ignore[import-not-found, unused-ignore]
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # type: ignore[import-not-found, unused-ignore]
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # type: ignore[import-not-found, unused-ignore]

MODEL_SEED = 1234
ADAPTER_SEEDS = {"v1": 101, "v2": 202, "v3": 303}
# init_lora_weights=False leaves nn.Linear's default init on A and B; B is scaled up so each adapter moves
# greedy outputs visibly away from the base model and from the other adapters.
LORA_B_SCALE = 2.0
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")

HIDDEN = 256
LAYERS = 2
HEADS = 4
HEAD_DIM = 64
INTERMEDIATE = 512
MAX_POSITIONS = 1024
TARGET_VOCAB = 1024
# Wider than Llama's default 0.02: a peaked next-token distribution keeps greedy picks clear of near-ties.
INIT_STD = 0.2

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A gateway sits in front of the inference servers and routes every request.",
    "Each tenant brings its own adapter, and the adapter weights change over time.",
    "The cache keeps blocks of tokens so that a repeated prompt is computed only once.",
    "When the weights change, the cached blocks must not be reused for the new version.",
    "She opened the window, looked at the garden, and counted the birds on the fence.",
    "Numbers like 1, 2, 3, 42, 100 and 2024 appear in many ordinary documents.",
    "He wrote a short letter to his friend about the weather, the harvest and the market.",
    "Small models are useful for tests because they start quickly and use little memory.",
    "Please summarize the following text in one sentence and answer the question below.",
    "The library opens at nine in the morning and closes at six in the evening.",
    "Rain fell all night, and in the morning the streets were bright and clean.",
    "A careful engineer measures twice, writes the result down, and then cuts once.",
    "The server answered with a list of models, a version string and a status code.",
    "Questions, answers, lists and tables: the assistant can write all of them.",
    "Once upon a time there was a little village between two green hills.",
    "What is the capital of France? The capital of France is Paris.",
    "user: hello there! assistant: hello, how can I help you today?",
    "Every block hash depends on the parent block, the token ids and some extra keys.",
    "They walked along the shore, talking about books, music, travel and old friends.",
)


def _corpus() -> list[str]:
    """A small built-in English corpus, in a fixed order."""
    lines: list[str] = []
    n = len(_SENTENCES)
    for i in range(n):
        lines.append(_SENTENCES[i])
        lines.append(f"{_SENTENCES[i]} {_SENTENCES[(i * 7 + 3) % n]}")
        lines.append(f"{_SENTENCES[(i * 3 + 1) % n].lower()} {_SENTENCES[(i * 5 + 2) % n].upper()}")
    return lines * 4


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus (every byte is in the vocabulary: no unknown tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_tokenizer(tok: Tokenizer, model_dir: Path) -> None:
    tok.save(str(model_dir / "tokenizer.json"))
    _write_json(
        model_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(model_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _seed(seed: int) -> None:
    torch.manual_seed(seed)


def build_model(tok: Tokenizer, model_dir: Path) -> None:
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        initializer_range=INIT_STD,
    )
    _seed(MODEL_SEED)
    # transformers' model classes are partly untyped: handle the instance as Any.
    model: Any = cast(Any, LlamaForCausalLM)(config)
    model = model.to(torch.bfloat16).eval()
    model.config.name_or_path = "base"
    model.save_pretrained(model_dir, safe_serialization=True)


def build_adapter(base_dir: Path, out_dir: Path, seed: int) -> None:
    """A PEFT LoRA adapter on a fresh float32 copy of the base model, seeded by ``seed``."""
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    _seed(seed)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.mul_(LORA_B_SCALE)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    # PEFT records the (temporary) base model path here and in a model card. Nothing may resolve the base
    # model by name (no hub look-ups; vLLM ignores the field) and the bytes must not depend on the temp path.
    (out_dir / "README.md").unlink(missing_ok=True)
    config_path = out_dir / "adapter_config.json"
    adapter_config = json.loads(config_path.read_text(encoding="utf-8"))
    adapter_config["base_model_name_or_path"] = None
    # PEFT keeps target_modules as a set: its order follows string hash randomization.
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    _write_json(config_path, adapter_config)


def _greedy(model_dir: Path, adapter_dir: Path | None, prompt: str, steps: int = 8) -> list[int]:
    """Greedy token ids from transformers (a sanity check that adapters change outputs)."""
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=tok.pad_token_id)
    return [int(t) for t in out[0, ids.shape[1] :]]


def _check(root: Path) -> None:
    model_dir = root / "model"
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(chat, str) or not chat.startswith(BOS):
        raise RuntimeError(f"chat template renders badly: {chat!r}")
    prompt = "The gateway routes every request, and the cache keeps blocks of tokens"
    outs = {
        name: _greedy(model_dir, None if name == "base" else root / "adapters" / name, prompt)
        for name in ("base", *ADAPTER_SEEDS)
    }
    if len({tuple(v) for v in outs.values()}) != len(outs):
        raise RuntimeError(f"adapters do not change greedy outputs enough: {outs}")


def _manifest(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def build(out: Path) -> tuple[Path, dict[str, str], int]:
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the fixture is plain readable data
    try:
        model_dir = tmp / "model"
        model_dir.mkdir()
        tok = build_tokenizer()
        save_tokenizer(tok, model_dir)
        build_model(tok, model_dir)
        for name, seed in ADAPTER_SEEDS.items():
            build_adapter(model_dir, tmp / "adapters" / name, seed)
        _check(tmp)
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        manifest = _manifest(tmp)
        _write_json(tmp / "manifest.json", {"files": manifest})
        old: Path | None = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "fixture")
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, manifest, tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="folder to (re)create")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out, manifest, vocab = build(args.out)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    print(
        f"fixture {out}: model (vocab {vocab}, hidden {HIDDEN}, {LAYERS} layers) + adapters "
        f"{','.join(ADAPTER_SEEDS)}; {len(manifest)} files, digest {digest}, {time.monotonic() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
