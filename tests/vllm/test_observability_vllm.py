"""Every request leaves evidence: a span with the effective model's identity, and Prometheus metrics."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.core.wire import replica_id
from gateway.dev.vllm_process import VllmProcess
from gateway.proof.experiment import complete, long_prompt
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, Gateway, GatewayFactory, kvgate_json, until_serves

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_spans_and_metrics_after_real_traffic(
    gateway: Gateway, redis_server: EmbeddedRedis, fixture_dir: Path, http: aiohttp.ClientSession
) -> None:
    published = await kvgate_json(
        "publish",
        "tenant-9",
        str(fixture_dir / "adapters" / "v1"),
        redis_url=redis_server.url,
        store=gateway.store,
    )
    await until_serves(http, gateway.url, "tenant-9", name=published["name"])
    gateway.spans.clear()
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        for _ in range(2):  # the second request is warm: routed by prefix, served from the cache
            await client.completions.create(
                model="tenant-9", prompt=long_prompt(), max_tokens=2, temperature=0
            )
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nobody", prompt="x")

    spans = [s for s in gateway.spans.get_finished_spans() if s.name == "kvgate.proxy"]
    assert len(spans) == 3
    warm = dict(spans[1].attributes or {})
    assert warm["gen_ai.request.model"] == "tenant-9"
    assert warm["gen_ai.operation.name"] == "text_completion"
    assert warm["kvgate.version.name"] == published["name"]
    assert warm["kvgate.version.digest"] == published["digest"]
    assert warm["kvgate.epoch"] == 1
    assert warm["kvgate.base_model"] == "base"
    assert warm["kvgate.replica.loaded_root"] == published["path"]
    assert warm["kvgate.routing.decision"] == "prefix"
    assert warm["kvgate.prefix.predicted_hit"] is True
    assert isinstance(warm["kvgate.backend.cached_tokens"], int)
    assert warm["kvgate.backend.cached_tokens"] >= 384
    assert isinstance(warm["kvgate.prefix.block_key"], str)
    loads = [s for s in gateway.spans.get_finished_spans() if s.name == "kvgate.load"]
    assert [dict(s.attributes or {})["kvgate.version.name"] for s in loads] == [published["name"]]
    assert spans[2].status.status_code.name == "ERROR"

    async with http.get(f"{gateway.url}/metrics", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as response:
        assert response.status == 200
        text = await response.text()
    assert 'kvgate_requests_total{logical_id="tenant-9",outcome="200"} 2.0' in text
    assert 'kvgate_requests_total{logical_id="unknown",outcome="not_found_error"} 1.0' in text
    assert 'kvgate_routing_decisions_total{decision="prefix"}' in text
    assert 'kvgate_adapter_loads_total{outcome="loaded"' in text
    assert 'kvgate_backend_cached_tokens_total{logical_id="tenant-9"}' in text
    assert "kvgate_time_to_first_byte_seconds_bucket" in text
    assert "kvgate_snapshot_staleness_seconds" in text
    cached = [
        line
        for line in text.splitlines()
        if line.startswith('kvgate_backend_cached_tokens_total{logical_id="tenant-9"}')
    ]
    assert float(cached[0].split()[-1]) >= 384


async def test_the_canary_audits_active_logical_ids(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    adapter = str(fixture_dir / "adapters" / "v2")
    await kvgate_json("publish", "tenant-c", adapter, redis_url=redis_server.url, store=tmp_path / "store")
    async with make_gateway(canary_interval=0.5) as started:
        answer = await complete(http, started.url, "tenant-c", "a short request makes tenant-c active")
        urls = {replica_id(r.url): r.url for r in vllm_replicas}  # metrics label replicas by URL
        labels = {
            "logical_id": "tenant-c",
            "replica": urls[answer.evidence["x-kvgate-replica"]],
            "verdict": "coherent",
        }
        registry = started.metrics.registry
        await eventually(
            lambda: (registry.get_sample_value("kvgate_audit_verdicts_total", labels) or 0) >= 1,
            "the canary's coherent verdict on the replica that answered",
            within=30,
        )
    for verdict in ("incoherent-on-warm-hit", "replica-mismatch", "nondeterministic"):
        assert not registry.get_sample_value("kvgate_audit_verdicts_total", {**labels, "verdict": verdict})
