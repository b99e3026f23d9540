"""Trace context and metrics on the request path, against the fast stub (edge cases of observability)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import until_healthy
from tests.support.stub_backend import StubState, build_stub

TOKEN = "admin-token"  # /metrics on the public listener takes the admin token


async def test_traceparent_is_propagated_and_spans_cover_load(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    stub = StubState()
    async with running(build_stub(stub)) as stub_url:
        settings = Settings(
            replicas=[stub_url],
            store=store.root,
            reconcile_interval=0.1,
            poll_interval=0.1,
            admin_token=TOKEN,
        )
        async with running(build_app(settings, redis, tracer_provider=provider)) as url:
            body = {"model": "tenant-42", "prompt": "p" * 600, "max_tokens": 1}
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{url}/v1/completions", json=body) as response,
            ):
                assert response.status == 200
                prefix_key = response.headers["x-kvgate-prefix-key"]
    (proxy_span,) = [s for s in spans.get_finished_spans() if s.name == "kvgate.proxy"]
    assert proxy_span.context is not None
    trace_id = format(proxy_span.context.trace_id, "032x")
    traceparent = stub.received_headers[-1]["traceparent"]
    assert traceparent.split("-")[1] == trace_id
    attributes = dict(proxy_span.attributes or {})
    assert attributes["kvgate.routing.decision"] == "loaded"
    assert attributes["kvgate.prefix.block_key"] == prefix_key
    names = {s.name for s in spans.get_finished_spans()}
    assert {"kvgate.proxy", "kvgate.load"} <= names
    provider.shutdown()


async def test_every_decision_observes_its_predicted_prefix_match(
    redis: Redis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    # two replicas: with one, nothing is to be chosen and a request is keyed by its first block only
    async with running(build_stub(StubState())) as stub_a, running(build_stub(StubState())) as stub_b:
        settings = Settings(replicas=[stub_a, stub_b], store=store.root, admin_token=TOKEN)
        app = build_app(settings, redis)
        async with running(app) as url, aiohttp.ClientSession() as http:
            await until_healthy(url)
            body = {"model": "tenant-42", "prompt": "p" * 1100, "max_tokens": 1}  # 4 full 256-char blocks
            for _ in range(2):  # a load (nothing known), then a warm hit on all 4 blocks
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    assert response.status == 200
            async with http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response:
                text = await response.text()
    assert 'kvgate_prefix_matched_blocks_count{source="none"} 1.0' in text  # the load
    assert 'kvgate_prefix_matched_blocks_count{source="predicted"} 1.0' in text
    assert 'kvgate_prefix_matched_blocks_sum{source="predicted"} 4.0' in text
