"""Synthetic adapter directories and the shapes of the fixtures that make and publish them."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

MakeAdapter = Callable[..., Path]

Publish = Callable[[str, bytes], Awaitable[str]]


def swap_bytes(path: Path, source: Path) -> dict[str, bytes]:
    """Write ``source``'s files over the store directory ``path`` (as a divergent volume would show)."""
    saved = {f.name: f.read_bytes() for f in path.iterdir()}
    for name in saved:
        (path / name).chmod(0o644)
        if (source / name).is_file():
            (path / name).write_bytes((source / name).read_bytes())
    return saved


def swap_back(path: Path, saved: dict[str, bytes]) -> None:
    for name, data in saved.items():
        (path / name).write_bytes(data)
        (path / name).chmod(0o444)


ATTENTION = ("q_proj", "v_proj")


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file of zero-filled bf16 tensors of SHAPES (its header as the format writes it)."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


def llama_base(root: Path, *, hidden: int = 64, layers: int = 2) -> Path:
    """A base model directory as transformers saves a Llama: config.json and model.safetensors (zeros)."""
    root.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": layers, "intermediate_size": 2 * hidden}  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": [32, hidden]}
    for layer in range(layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"model.layers.{layer}.self_attn.{module}.weight"] = [hidden, hidden]
        shapes[f"model.layers.{layer}.mlp.up_proj.weight"] = [2 * hidden, hidden]
    write_safetensors(root / "model.safetensors", shapes)
    return root


def lora_adapter(
    root: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    r: int = 4,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
) -> Path:
    """A PEFT LoRA adapter directory for a Llama of HIDDEN size and LAYERS layers (zero weights)."""
    root.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(modules)}
    (root / "adapter_config.json").write_text(json.dumps(config))
    shapes = {}
    for layer in range(layers):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{prefix}.lora_A.weight"] = [r, hidden]
            shapes[f"{prefix}.lora_B.weight"] = [hidden, r]
    write_safetensors(root / "adapter_model.safetensors", shapes)
    return root
