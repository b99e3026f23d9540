"""kvgate's publish-time check of ``adapter_config.json`` against vLLM's own reader: every config vLLM
0.32's ``PEFTHelper`` (``from_local_dir`` then ``validate_legal``) refuses, kvgate refuses, and every one
kvgate accepts, vLLM accepts. (kvgate is stricter on a few vLLM reads without a word and fails on later,
at weight loading, or serves as NaN: ``r`` a float or a boolean, ``target_modules`` empty or not names,
another ``peft_type``, a NaN ``lora_alpha``.) No replica is started: vLLM's python reads each file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from gateway.core.errors import InvalidAdapter
from gateway.core.identity import check_adapter_config
from tests.adapters.test_peft_config import ACCEPTED, REFUSED
from tests.vllm.conftest import _required_path

STRICTER = {"r a float", "r true", "target_modules empty", "target_modules a number", "another peft_type",
            "lora_alpha NaN"}  # fmt: skip
_READ = """
import json, os, sys
from vllm.config.lora import LoRAConfig
from vllm.lora.peft_helper import PEFTHelper
verdicts = {}
for name in sorted(os.listdir(sys.argv[1])):
    try:
        PEFTHelper.from_local_dir(os.path.join(sys.argv[1], name), None).validate_legal(
            LoRAConfig(max_lora_rank=64))
        verdicts[name] = "loaded"
    except Exception as exc:
        verdicts[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(verdicts))
"""


def _kvgate_accepts(raw: bytes) -> bool:
    try:
        check_adapter_config(raw)
    except InvalidAdapter:
        return False
    return True


def test_kvgate_refuses_every_config_vllm_refuses(tmp_path: Path) -> None:
    python = _required_path("KVGATE_VLLM_PYTHON")
    cases = {**{name: raw for name, (raw, _) in REFUSED.items()}, **ACCEPTED}
    for i, raw in enumerate(cases.values()):
        (tmp_path / f"{i:02d}").mkdir()
        (tmp_path / f"{i:02d}" / "adapter_config.json").write_bytes(raw)
    read = subprocess.run(
        [str(python), "-c", _READ, str(tmp_path)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}, check=True,
    )  # fmt: skip
    verdicts = dict(zip(cases, json.loads(read.stdout.splitlines()[-1]).values(), strict=True))
    for name, raw in cases.items():
        vllm_loads = verdicts[name] == "loaded"
        if name in STRICTER:
            assert vllm_loads, (name, verdicts[name])
            assert not _kvgate_accepts(raw), name
        else:
            assert _kvgate_accepts(raw) == vllm_loads, (name, verdicts[name])
    assert {name for name, verdict in verdicts.items() if verdict == "loaded"} == set(ACCEPTED) | STRICTER
