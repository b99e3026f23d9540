"""Whether an adapter can fit its base model, checked before ``kvgate publish`` or ``kvgate rollout`` writes
anything: a candidate built for another base otherwise publishes fine and then fails every load (vLLM's
``size mismatch``), on every replica.

Where kvgate can read both (the adapter's directory, and the base's: ``base_model_dirs`` or the root the
replicas list), it compares what vLLM 0.32 will compare when it loads the adapter
(``vllm/lora/lora_model.py``, ``utils.parse_fine_tuned_lora_name``): every LoRA tensor of
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) names a
module of the base (``<module>.weight`` among the base's ``*.safetensors``: a layer past the base's
``num_hidden_layers`` is no module of it), ``lora_A`` is ``r x inputs`` of that module and ``lora_B`` is
``outputs x r``, and ``r`` is the config's (``adapter_config.json``; unless a ``rank_pattern`` sets ranks
per module). Only the safetensors headers are read (a few KB, whatever the weights' size). Where either
side cannot be read (no directory, no header, another format) nothing is refused: the load decides, and
the rollout gate aborts a candidate that fails every request (``proof/gate.py``).
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from gateway.core.errors import InvalidAdapter
from gateway.core.identity import ADAPTER_CONFIG

ADAPTER_TENSORS = "adapter_model.safetensors"  # the one file vLLM reads an adapter's tensors from
HEADER_MAX = 64 * 1024 * 1024  # a safetensors header larger than this is not read (not a weight file)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
Shapes = dict[str, list[int]]


def header_shapes(path: Path) -> Shapes | None:
    """Tensor name -> shape, from a safetensors file's header; None when it cannot be read as one."""
    try:
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) != 8:
                return None
            (size,) = struct.unpack("<Q", prefix)
            if size > HEADER_MAX:
                return None
            header = json.loads(file.read(size))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    shapes: Shapes = {}
    for name, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if name != "__metadata__" and isinstance(shape, list) and all(isinstance(n, int) for n in shape):
            shapes[name] = shape
    return shapes


def base_shapes(base_dir: Path) -> Shapes | None:
    """Every weight's shape in the base's ``*.safetensors`` (shards included); None when none is read."""
    shapes: Shapes = {}
    try:
        files = sorted(base_dir.glob("*.safetensors"))
    except OSError:
        return None
    for path in files:
        found = header_shapes(path)
        if found is None:
            return None
        shapes.update(found)
    return shapes or None


def _json_object(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def misfits(adapter_dir: Path, base_dir: Path) -> list[str] | None:
    """Why the adapter cannot be loaded on the base (empty: it fits), or None when either side cannot be
    read."""
    config, base_config = _json_object(adapter_dir / ADAPTER_CONFIG), _json_object(base_dir / "config.json")
    tensors = header_shapes(adapter_dir / ADAPTER_TENSORS)
    shapes = base_shapes(base_dir)
    if config is None or base_config is None or tensors is None or shapes is None:
        return None
    rank = config.get("r") if not config.get("rank_pattern") else None
    layers = base_config.get("num_hidden_layers")
    hidden = base_config.get("hidden_size")
    found: list[str] = []
    for name, shape in sorted(tensors.items()):
        parts = name.removeprefix("base_model.model.").split(".")
        if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
            continue  # embeddings, modules to save: vLLM's own checks
        module, part = ".".join(parts[:-2]), parts[-2]
        if any(line.startswith(f"{module}: ") for line in found):
            continue  # one reason per module
        weight = shapes.get(f"{module}.weight")
        if weight is None:
            layer = _LAYER.search(f".{module}.")
            if layer is not None and isinstance(layers, int) and int(layer[1]) >= layers:
                found.append(f"{module}: layer {layer[1]}, but the base has {layers} (num_hidden_layers)")
            else:
                found.append(f"{module}: the base has no such module")
            continue
        if len(shape) != 2 or len(weight) != 2:
            continue
        outputs, inputs = weight
        size = f"{part} is {shape[0]}x{shape[1]}, the base's {module} is {outputs}x{inputs}"
        if part == "lora_A" and shape[1] != inputs:
            found.append(f"{module}: {size} ({inputs} inputs; hidden size {hidden})")
        elif part == "lora_B" and shape[0] != outputs:
            found.append(f"{module}: {size} ({outputs} outputs; hidden size {hidden})")
        elif isinstance(rank, int) and shape[0 if part == "lora_A" else 1] != rank:
            found.append(
                f"{module}: {part} is {shape[0]}x{shape[1]}, not of rank r={rank} ({ADAPTER_CONFIG})"
            )
    return found


def check_fit(adapter_dir: Path, base_dir: Path | None, base: str) -> None:
    """``InvalidAdapter`` naming why, when the adapter cannot be loaded on BASE (its files at BASE_DIR)."""
    if base_dir is None:
        return
    found = misfits(adapter_dir, base_dir)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise InvalidAdapter(
            f"the adapter does not fit base {base!r} (read at {base_dir}): {found[0]}{more}; "
            "it was built for another base",
            param="base",
        )
