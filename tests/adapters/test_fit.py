"""An adapter that cannot fit its base (issue 28, item 6) is refused by ``kvgate publish`` and ``kvgate
rollout`` with one clear line and nothing written, where kvgate can read both: its LoRA tensors against the
base's modules (hidden size, layer count, shapes) and its config's ``r``. Where either cannot be read,
nothing is refused (the load decides). Tiny synthetic Llama directories; the fixture's real adapters fit
the fixture's base (tests/vllm/test_rollout_vllm.py publishes them with the base's directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway.adapters.fit import check_fit, misfits
from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.errors import InvalidAdapter
from gateway.table.epoch_table import EpochTable
from tests.cli.test_cli import kvgate
from tests.support.adapter_files import llama_base, lora_adapter


def test_an_adapter_of_its_base_fits_and_one_of_another_does_not(tmp_path: Path) -> None:
    base = llama_base(tmp_path / "base", hidden=64, layers=2)
    assert misfits(lora_adapter(tmp_path / "fits", hidden=64), base) == []
    wider = misfits(lora_adapter(tmp_path / "wider", hidden=128), base)
    assert wider is not None
    assert wider[0] == (
        "model.layers.0.self_attn.q_proj: lora_A is 4x128, the base's model.layers.0.self_attn.q_proj is "
        "64x64 (64 inputs; hidden size 64)"
    )
    deeper = misfits(lora_adapter(tmp_path / "deeper", hidden=64, layers=3), base)
    assert deeper == [
        "model.layers.2.self_attn.q_proj: layer 2, but the base has 2 (num_hidden_layers)",
        "model.layers.2.self_attn.v_proj: layer 2, but the base has 2 (num_hidden_layers)",
    ]
    other = misfits(lora_adapter(tmp_path / "other", modules=("c_attn",)), base)
    assert other is not None
    assert other[0] == "model.layers.0.self_attn.c_attn: the base has no such module"
    ranked = tmp_path / "ranked"
    lora_adapter(ranked, hidden=64, r=4)
    config = json.loads((ranked / "adapter_config.json").read_text())
    (ranked / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    reason = (misfits(ranked, base) or [""])[0]
    assert reason.endswith("lora_A is 4x64, not of rank r=8 (adapter_config.json)")


def test_nothing_is_refused_where_either_side_cannot_be_read(tmp_path: Path) -> None:
    base = llama_base(tmp_path / "base")
    wider = lora_adapter(tmp_path / "wider", hidden=128)
    check_fit(wider, None, "base")  # no directory of the base here
    assert misfits(wider, tmp_path / "missing") is None
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "config.json").write_text("{}")
    (tmp_path / "torn" / "model.safetensors").write_bytes(b"\xff" * 8)
    assert misfits(wider, tmp_path / "torn") is None, "a base whose header cannot be read"
    (wider / "adapter_model.safetensors").write_bytes(b"not safetensors")
    assert misfits(wider, base) is None


async def test_publish_and_rollout_refuse_a_misfit_before_writing_anything(
    redis: Redis, table: EpochTable, tmp_path: Path
) -> None:
    base, store = llama_base(tmp_path / "base"), AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "t", lora_adapter(tmp_path / "v1"), "base", base_dir=base)
    before = (await redis.keys("*"), sorted(p.name for p in store.root.iterdir()))
    wider = lora_adapter(tmp_path / "wider", hidden=128)
    for attempt in (
        publish_adapter(table, store, "t", wider, "base", base_dir=base),
        rollout_adapter(table, store, "t", wider, "base", 2500, base_dir=base),
    ):
        with pytest.raises(InvalidAdapter, match=r"does not fit base 'base' .*: model\.layers\.0"):
            await attempt
    assert (await redis.keys("*"), sorted(p.name for p in store.root.iterdir())) == before
    state = await table.read_state("t")
    assert state is not None
    assert (state.epoch, state.candidate) == (1, None)


@pytest.mark.parametrize("command", [["publish"], ["rollout", "--percent", "25"]])
def test_the_cli_refuses_a_misfit_in_one_line(command: list[str], tmp_path: Path) -> None:
    """``kvgate publish`` / ``kvgate rollout`` with the base's directory (``--base-model-dirs``): exit 2,
    one line naming the module and both sizes, and the store as it was."""
    base, data = llama_base(tmp_path / "base"), tmp_path / "kvgate"
    dirs = ["--base-model-dirs", f"base={base}"]
    assert kvgate("publish", "t", str(lora_adapter(tmp_path / "v1")), *dirs, data_dir=data).returncode == 0
    stored = sorted((data / "store").iterdir())
    verb, *flags = command
    done = kvgate(verb, "t", str(lora_adapter(tmp_path / "wider", hidden=128)), *flags, *dirs, data_dir=data)
    assert done.returncode == 2, done.stderr  # the caller's input: 2, as every 4xx
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line and line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"kvgate {verb}: "), lines[0]
    assert "the adapter does not fit base 'base'" in lines[0]
    assert "lora_A is 4x128, the base's model.layers.0.self_attn.q_proj is 64x64" in lines[0]
    assert sorted((data / "store").iterdir()) == stored, "nothing stored"
    history = kvgate("history", "t", "--json", data_dir=data)
    assert [e["action"] for e in json.loads(history.stdout)["history"]] == ["publish"]
