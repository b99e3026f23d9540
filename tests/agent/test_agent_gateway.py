"""kvgate with an object store: each replica loads from its agent's verified copy, and a version whose bytes
fail verification is a 503 naming the logical ID only (never the versioned name or an object key), counted,
never loaded. The replica is the stub backend; the agent and the S3 server are real.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import obstore
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.objstore import ObjectStore
from gateway.adapters.publish import publish_adapter
from gateway.agent.fetch import STAMPS
from gateway.agent.server import build_agent
from gateway.app.wiring import build_app
from gateway.core.wire import ADMIN_TOKEN_HEADER
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

TOKEN = "agent-token"
ADMIN = "admin-token"


def fetches(metrics: Metrics, replica: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvgate_agent_fetches_total", {"replica": replica, "outcome": outcome}
    )
    return value or 0.0


async def test_a_replica_loads_its_agents_verified_copy_and_a_tampered_version_is_a_503(
    redis: Redis, redis_server: EmbeddedRedis, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    table = EpochTable(redis)
    store = ObjectStore(s3_url)
    v1 = await publish_adapter(table, store, "tenant-42", make_adapter(os.urandom(50_000)), "base")
    local = tmp_path / "agent"
    state = StubState()
    metrics = Metrics()
    async with running(build_stub(state)) as stub:
        agent_app = build_agent(s3_url, local, token=TOKEN, replica_url=stub, agent_root=str(local),
                                disk_bytes=1 << 30)  # fmt: skip
        async with running(agent_app) as agent:
            settings = Settings(
                replicas=[stub], store=s3_url, replica_agents=[f"{stub}={agent}"], agent_root=str(local),
                agent_token=TOKEN, admin_token=ADMIN, reconcile_interval=0.2, poll_interval=0.3,
            )  # fmt: skip
            async with running(build_app(settings, redis, metrics=metrics)) as url:
                await until_healthy(url)
                async with openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key="unused", max_retries=0
                ) as client:
                    done = await client.completions.create(model="tenant-42", prompt="Hello", max_tokens=2)
                    assert done.model == "tenant-42"
                    assert state.adapters[v1.name] == f"{local}/{v1.digest}", "loaded from the agent's copy"
                    assert (local / v1.digest / "adapter_model.safetensors").is_file()
                    assert fetches(metrics, stub, "ready") == 1
                    status = await _cli_status(redis_server, s3_url)
                    assert status["logical_ids"][0]["loaded_on"] == [stub], "kvgate status sees it loaded"

                    v2 = await publish_adapter(
                        table, store, "tenant-42", make_adapter(os.urandom(50_000)), "base"
                    )
                    key = f"{v2.digest}/adapter_model.safetensors"
                    original = bytes(obstore.get(store.client, key).bytes())
                    obstore.put(store.client, key, original[::-1])  # the bucket's bytes changed after publish
                    await _until_current(url, v2.digest)
                    with pytest.raises(openai.APIStatusError) as refused:
                        await client.completions.create(model="tenant-42", prompt="Hello", max_tokens=2)
                    assert refused.value.status_code == 503
                    error = refused.value.body  # the openai client hands over the body's "error" object
                    assert isinstance(error, dict), error
                    message = error["message"]
                    assert "'tenant-42'" in message, message
                    assert "failed verification" in message, message
                    for secret in ("@", "s3://", v2.digest[:16], "safetensors"):
                        assert secret not in message, message
                    assert error["code"] == "adapter_not_ready"
                    assert fetches(metrics, stub, "changed") == 1
                    assert v2.name not in state.adapters, "never loaded"
                    assert not (local / v2.digest).exists()
                    partial = [p for p in local.iterdir() if p.name.startswith(".") and p.name != STAMPS]
                    assert not partial, "no partial directory"


async def _cli_status(redis_server: EmbeddedRedis, store: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "status", "--json", "--store", store,
        "--redis-url", redis_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    doc: dict[str, Any] = json.loads(out)
    return doc


async def _until_current(url: str, digest: str) -> None:
    """Wait until kvgate's snapshot has DIGEST current (the change log brings it within a heartbeat)."""
    async with aiohttp.ClientSession() as http:

        async def current() -> bool:
            async with http.get(f"{url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN}) as answer:
                status = await answer.json()
            return bool(status["versions"]["tenant-42"]["digest"] == digest)

        await eventually(current, f"{digest[:16]} is current in kvgate's snapshot")


def test_serve_refuses_an_object_store_with_a_replica_without_an_agent(tmp_path: Path) -> None:
    """Fail closed: vLLM cannot read s3:// itself, so a replica without an agent could never load."""
    answer = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--store", "s3://bucket/store",
         "--data-dir", str(tmp_path),
         "--replica", "http://127.0.0.1:9001", "--replica", "http://127.0.0.1:9002",
         "--replica-agents", "http://127.0.0.1:9001=http://127.0.0.1:9101"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert answer.returncode != 0
    assert "every replica needs a kvgate agent" in answer.stderr, answer.stderr
    assert "none for http://127.0.0.1:9002" in answer.stderr, answer.stderr
