"""``adapter_config.json`` checked at publish as vLLM will read it: a config every load would fail on is
refused with the reason, before anything is written (``core.identity.check_adapter_config``; checked
against vLLM's own ``PEFTHelper`` in ``tests/vllm/test_peft_config_vllm.py``)."""

from __future__ import annotations

import json
import re

import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.errors import InvalidAdapter
from gateway.core.identity import check_adapter_config
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter

GOOD = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def _dumped(config: object) -> bytes:
    return json.dumps(config).encode()


# name -> (adapter_config.json's bytes, what the refusal says)
REFUSED: dict[str, tuple[bytes, str]] = {
    "empty object": (b"{}", "lacks r, lora_alpha, target_modules"),
    "r as a word": (_dumped({**GOOD, "r": "eight"}), 'r must be a positive integer, not "eight"'),
    "UTF-16": (json.dumps(GOOD).encode("utf-16"), "is not UTF-8 text"),
    "UTF-8 with a BOM": (("\ufeff" + json.dumps(GOOD)).encode(), "is not valid JSON"),
    "not JSON": (b"[1, 2", "is not valid JSON"),
    "a list": (b"[1]", "is not a JSON object"),
    "r zero": (_dumped({**GOOD, "r": 0}), "r must be a positive integer, not 0"),
    "r a float": (_dumped({**GOOD, "r": 8.5}), "r must be a positive integer, not 8.5"),
    "r true": (_dumped({**GOOD, "r": True}), "r must be a positive integer, not true"),
    "no lora_alpha": (_dumped({k: v for k, v in GOOD.items() if k != "lora_alpha"}), "lacks lora_alpha"),
    "lora_alpha a word": (
        _dumped({**GOOD, "lora_alpha": "16"}),
        'lora_alpha must be a finite number, not "16"',
    ),
    "lora_alpha NaN": (
        json.dumps({**GOOD, "lora_alpha": float("nan")}).encode(),
        "lora_alpha must be a finite",
    ),
    "no target_modules": (_dumped({k: v for k, v in GOOD.items() if k != "target_modules"}), "lacks target"),
    "target_modules empty": (_dumped({**GOOD, "target_modules": []}), "target_modules must be"),
    "target_modules a number": (_dumped({**GOOD, "target_modules": 3}), "target_modules must be"),
    "another peft_type": (_dumped({**GOOD, "peft_type": "IA3"}), 'peft_type must be LORA, not "IA3"'),
    "a bad rank_pattern": (_dumped({**GOOD, "rank_pattern": {"q_proj": -1}}), "rank_pattern must map"),
    "a bias": (_dumped({**GOOD, "bias": "all"}), 'bias must be "none"'),
    "DoRA": (_dumped({**GOOD, "use_dora": True}), "vLLM does not support DoRA"),
}
ACCEPTED: dict[str, bytes] = {
    "the minimum": _dumped(GOOD),
    "no peft_type": _dumped({k: v for k, v in GOOD.items() if k != "peft_type"}),
    "a float alpha, a module regex": _dumped({**GOOD, "lora_alpha": 8.5, "target_modules": "all-linear"}),
    "PEFT's full config": _dumped(
        {
            **GOOD,
            "bias": "none",
            "use_dora": False,
            "lora_bias": False,
            "rank_pattern": {"q_proj": 4},
            "alpha_pattern": {},
            "use_rslora": True,
            "modules_to_save": None,
            "task_type": "CAUSAL_LM",
        }
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_config_no_replica_could_load_is_refused_with_the_reason(case: str) -> None:
    raw, why = REFUSED[case]
    with pytest.raises(InvalidAdapter, match=r"^adapter_config\.json ") as refused:
        check_adapter_config(raw)
    assert why in refused.value.message


@pytest.mark.parametrize("case", ACCEPTED)
def test_a_config_vllm_loads_is_accepted(case: str) -> None:
    assert check_adapter_config(ACCEPTED[case])["r"] in (4, 8)


@pytest.mark.parametrize("case", ["empty object", "r as a word", "UTF-16"])
async def test_publish_refuses_it_and_writes_nothing(
    case: str, make_adapter: MakeAdapter, store: AdapterStore, table: EpochTable, redis: Redis
) -> None:
    """The issue's three: each was published, and every load then failed on the replica."""
    source = make_adapter(b"v1")
    (source / "adapter_config.json").write_bytes(REFUSED[case][0])
    with pytest.raises(InvalidAdapter, match=re.escape(REFUSED[case][1])):
        await publish_adapter(table, store, "tenant-42", source, "base")
    assert not store.root.exists() or list(store.root.iterdir()) == []
    assert await table.read_state("tenant-42") is None
    assert await redis.keys("*tenant-42*") == []


def test_the_store_checks_the_copy_it_stores(make_adapter: MakeAdapter, store: AdapterStore) -> None:
    """A config changed to a bad one after the scan (same size) is refused from the copy: nothing stored."""
    source = make_adapter(b"v1")
    manifest = store.scan(source)
    config = source / "adapter_config.json"
    good = config.read_bytes()
    config.write_bytes(good.replace(b'"r": 8', b'"r": 0'))
    with pytest.raises(InvalidAdapter, match="r must be a positive integer"):
        store.ingest(source, manifest)
    assert list(store.root.iterdir()) == []
