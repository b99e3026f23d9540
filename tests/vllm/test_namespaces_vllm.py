"""Epoch namespaces through ``cache_salt`` on real vLLM: a bump invalidates one tenant, nobody else."""

from __future__ import annotations

import secrets
from pathlib import Path

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.dev.vllm_process import VllmProcess
from gateway.proof.audit import GatewayTarget
from gateway.proof.experiment import complete, long_prompt
from gateway.table.callers import CallerTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, Gateway, GatewayFactory, kvgate_json, until_serves

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_bump_misses_for_that_tenant_only_and_client_salts_are_ignored(
    gateway: Gateway, redis_server: EmbeddedRedis, fixture_dir: Path, http: aiohttp.ClientSession
) -> None:
    redis_url, store = redis_server.url, gateway.store
    await kvgate_json(
        "publish", "tenant-a", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    b = await kvgate_json(
        "publish", "tenant-b", str(fixture_dir / "adapters" / "v2"), redis_url=redis_url, store=store
    )
    await GatewayTarget(gateway.url, "tenant-b", ADMIN_TOKEN).until_serving(http, b["digest"])
    prompt = long_prompt()
    for tenant in ("tenant-a", "tenant-b"):
        await complete(http, gateway.url, tenant, prompt)
        assert (await complete(http, gateway.url, tenant, prompt)).cached_tokens >= 384

    bumped = await kvgate_json("bump", "tenant-a", redis_url=redis_url, store=store)
    assert bumped["epoch"] == 2
    await until_serves(http, gateway.url, "tenant-a", epoch=2)  # the hint reaches the snapshot
    after_a = await complete(http, gateway.url, "tenant-a", prompt)
    assert after_a.evidence["x-kvgate-epoch"] == "2"
    assert after_a.cached_tokens == 0, "a bump is a new cache namespace: the next request misses"
    assert (await complete(http, gateway.url, "tenant-a", prompt)).cached_tokens >= 384
    assert (await complete(http, gateway.url, "tenant-b", prompt)).cached_tokens >= 384, (
        "other tenants keep theirs"
    )

    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        chosen = await client.completions.create(
            model="tenant-b",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": "attacker"},
        )
    assert chosen.usage is not None
    assert chosen.usage.prompt_tokens_details is not None
    # Forwarded, a new salt would have missed; ignored, the request lands in tenant-b's namespace.
    assert (chosen.usage.prompt_tokens_details.cached_tokens or 0) >= 384


async def test_with_api_keys_tenants_never_share_base_model_prefix_blocks(
    make_gateway: GatewayFactory, vllm_replicas: list[VllmProcess], session_redis: Redis
) -> None:
    """The prefix-cache timing side channel between tenants (vLLM CVE-2025-46570), closed on the base model:
    a tenant's repeated prompt hits its own cache; the same prompt from another tenant does not."""
    callers = CallerTable(session_redis)
    run = secrets.token_hex(4)  # fresh tenants: nothing of theirs is cached yet on the session's replicas
    key_a, _ = await callers.create(f"acme-{run}", [], base=True)
    key_b, _ = await callers.create(f"bolt-{run}", [], base=True)
    prompt = long_prompt()

    async def cached(url: str, key: str) -> int:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            answer = await client.completions.create(model="base", prompt=prompt, max_tokens=1, temperature=0)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0

    async with make_gateway(auth="api-keys", replicas=[vllm_replicas[0].url]) as started:
        a_first, a_again = await cached(started.url, key_a), await cached(started.url, key_a)
        b_first, b_again = await cached(started.url, key_b), await cached(started.url, key_b)
    assert a_again >= 384, "a tenant's own base-model prompt is warm"
    assert (a_first, b_first) == (0, 0), "the same prompt from another tenant finds nothing cached"
    assert b_again >= 384


async def test_purge_all_resets_every_replica_after_an_update(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    redis_url, store = redis_server.url, tmp_path / "store"
    for tenant, adapter in (("tenant-p", "v1"), ("tenant-q", "v2")):
        await kvgate_json(
            "publish", tenant, str(fixture_dir / "adapters" / adapter), redis_url=redis_url, store=store
        )
    prompt = long_prompt()
    async with make_gateway(invalidation="purge-all") as started:
        url, metrics = started.url, started.metrics
        for tenant in ("tenant-p", "tenant-q"):
            await complete(http, url, tenant, prompt)
            assert (await complete(http, url, tenant, prompt)).cached_tokens >= 384
        await kvgate_json(
            "publish", "tenant-q", str(fixture_dir / "adapters" / "v3"), redis_url=redis_url, store=store
        )

        def purged() -> float:
            return sum(
                metrics.registry.get_sample_value(
                    "kvgate_prefix_purges_total", {"replica": r.url, "outcome": "purged"}
                )
                or 0.0
                for r in vllm_replicas
            )

        await eventually(lambda: purged() >= len(vllm_replicas), "every replica purged", within=20)
        unrelated = await complete(http, url, "tenant-p", prompt)
        assert unrelated.cached_tokens == 0, "purge-all drops every tenant's prefix cache"
        assert (await complete(http, url, "tenant-p", prompt)).cached_tokens >= 384
