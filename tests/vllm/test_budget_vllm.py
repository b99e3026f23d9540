"""More tenants than the replicas keep loaded, on the two real vLLM replicas (``--max-loras 4
--max-cpu-loras 8``) behind a kvgate whose budget is 2 adapters per replica: six tenants, so every round
evicts. Every request is served, and each answer is the one its headers' version gives cold.

The tenants share the fixture's three adapters (tenant ``i`` has ``v{1 + i % 3}``'s bytes), each under
its own versioned name. The reference answers are taken without kvgate, before it starts: each fixture
adapter loaded straight onto a replica from the fixture directory under a name of its own, asked cold (a
fresh ``cache_salt``), then unloaded. A kvgate that served tenant ``i`` another version than ``v{1 + i % 3}``
cannot agree with itself here: the expected answer follows the tenant, never what kvgate reports.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from gateway.core.wire import cold_salt
from gateway.dev.vllm_process import VllmProcess
from gateway.fleet.backends import fetch_model_list
from gateway.proof.experiment import Sample, complete
from gateway.table.redis_server import EmbeddedRedis
from tests.vllm.conftest import GatewayFactory, kvgate_json, post_json

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
TENANTS = 6
BUDGET = 2  # per replica: 4 adapters kept loaded for 6 tenants
ROUNDS = 3
CONCURRENCY = 3
PROMPT = "The boats came in at dawn, and the harbour master counted"
TOLERANCE = 0.02  # a batch of other adapters may move a logprob in its last digits; never the text


async def cold_references(
    http: aiohttp.ClientSession, replica: VllmProcess, fixture_dir: Path
) -> dict[str, Sample]:
    """Fixture adapter (``v1``..``v3``) -> its cold answer to ``PROMPT``, straight from ``replica``."""
    reference = {}
    for version in ("v1", "v2", "v3"):
        name = f"budget-reference-{version}"
        body: dict[str, object] = {"lora_name": name, "lora_path": str(fixture_dir / "adapters" / version)}
        await post_json(http, f"{replica.url}/v1/load_lora_adapter", body)
        try:
            reference[version] = await complete(http, replica.url, name, PROMPT, cache_salt=cold_salt())
        finally:
            await post_json(http, f"{replica.url}/v1/unload_lora_adapter", {"lora_name": name})
    assert not {f"budget-reference-{v}" for v in reference} & set(
        (await fetch_model_list(http, replica.url)).adapters
    ), "nothing of the references stays for kvgate to find"
    return reference


async def test_more_tenants_than_loaded_adapters_each_answered_by_its_own_version(
    make_gateway: GatewayFactory, vllm_replicas: list[VllmProcess], redis_server: EmbeddedRedis,
    fixture_dir: Path, tmp_path: Path, http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    store = tmp_path / "store"
    reference = await cold_references(http, vllm_replicas[0], fixture_dir)
    assert len({s.text for s in reference.values()}) == 3, "the three adapters answer differently"
    published, expected = {}, {}
    for i in range(TENANTS):
        version = f"v{1 + i % 3}"
        published[f"many-{i}"] = await kvgate_json(
            "publish", f"many-{i}", str(fixture_dir / "adapters" / version), redis_url=redis_server.url,
            store=store,
        )  # fmt: skip
        expected[f"many-{i}"] = reference[version]
    async with make_gateway(max_adapters_per_replica=BUDGET, poll_interval=0.3, drain_grace=0.5) as gateway:
        order = [logical_id for _ in range(ROUNDS) for logical_id in published]
        random.Random(7).shuffle(order)
        answers: list[tuple[str, Sample]] = []

        async def worker() -> None:
            while order:
                logical_id = order.pop()
                answers.append((logical_id, await complete(http, gateway.url, logical_id, PROMPT)))

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        registry = gateway.metrics.registry
        loads = sum(s.value for m in registry.collect() if m.name == "kvgate_adapter_loads"
                    for s in m.samples if s.name.endswith("_total"))  # fmt: skip
        unloads = sum(s.value for m in registry.collect() if m.name == "kvgate_adapter_unloads"
                      for s in m.samples if s.name.endswith("_total"))  # fmt: skip
        waits = [(s.name, s.value) for m in registry.collect() if m.name == "kvgate_adapter_slot_wait_seconds"
                 for s in m.samples if s.name.endswith(("_sum", "_count"))]  # fmt: skip
    print(f"\n{len(answers)} answers, {loads:.0f} loads, {unloads:.0f} unloads, slot waits {waits}")
    assert len(answers) == TENANTS * ROUNDS, "every request served"
    for logical_id, answer in answers:
        assert answer.model == logical_id
        assert answer.evidence["x-kvgate-version"] == published[logical_id]["name"]
        assert answer.evidence["x-kvgate-digest"] == published[logical_id]["digest"]
        cold = expected[logical_id]  # by the tenant's own bytes, whatever kvgate says it served
        assert answer.text == cold.text, f"{logical_id}: {answer.text!r} != cold {cold.text!r}"
        assert answer.max_logprob_diff(cold) <= TOLERANCE
    assert unloads >= TENANTS - 2 * BUDGET, "the budget evicted (more tenants than slots)"
