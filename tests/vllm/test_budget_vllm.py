"""More tenants than the replicas keep loaded, on the two real vLLM replicas (``--max-loras 4
--max-cpu-loras 8``) behind a kvgate whose budget is 2 adapters per replica: six tenants, so every round
evicts. Every request is served, and each answer is the one its headers' version gives cold.

The tenants share the fixture's three adapters (tenant ``i`` has ``v{1 + i % 3}``'s bytes), each under
its own versioned name: the reference answers are computed once per set of bytes, cold, through kvgate.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest

from gateway.core.wire import ADMIN_TOKEN_HEADER, NAMESPACE_HEADER
from gateway.proof.experiment import Sample, complete
from gateway.table.redis_server import EmbeddedRedis
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory, kvgate_json

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
TENANTS = 6
BUDGET = 2  # per replica: 4 adapters kept loaded for 6 tenants
ROUNDS = 3
CONCURRENCY = 3
PROMPT = "The boats came in at dawn, and the harbour master counted"
TOLERANCE = 0.02  # a batch of other adapters may move a logprob in its last digits; never the text


async def test_more_tenants_than_loaded_adapters_each_answered_by_its_own_version(
    make_gateway: GatewayFactory, redis_server: EmbeddedRedis, fixture_dir: Path, tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:  # fmt: skip
    store = tmp_path / "store"
    published = {}
    for i in range(TENANTS):
        adapter = fixture_dir / "adapters" / f"v{1 + i % 3}"
        published[f"many-{i}"] = await kvgate_json(
            "publish", f"many-{i}", str(adapter), redis_url=redis_server.url, store=store
        )
    async with make_gateway(max_adapters_per_replica=BUDGET, poll_interval=0.3, drain_grace=0.5) as gateway:
        cold = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN, NAMESPACE_HEADER: "cold"}
        reference: dict[str, Sample] = {}
        for logical_id in ("many-0", "many-1", "many-2"):  # one per set of bytes
            sample = await complete(http, gateway.url, logical_id, PROMPT, headers=cold)
            reference[sample.evidence["x-kvgate-digest"]] = sample
        assert len({s.text for s in reference.values()}) == 3, "the three adapters answer differently"

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
        expected = reference[answer.evidence["x-kvgate-digest"]]
        assert answer.text == expected.text, f"{logical_id}: {answer.text!r} != cold {expected.text!r}"
        assert answer.max_logprob_diff(expected) <= TOLERANCE
    assert unloads >= TENANTS - 2 * BUDGET, "the budget evicted (more tenants than slots)"
