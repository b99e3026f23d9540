"""The object store on real vLLM: each of the session's two replicas has a ``kvgate agent`` with a local
directory of its own; a version published to the S3 server (moto's, a process) is fetched and verified by
the agent, loaded by vLLM from the agent's copy, and a warm answer through kvgate equals a cold run of the
same bytes on that replica.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.adapters.objstore import ObjectStore
from gateway.adapters.publish import publish_adapter
from gateway.agent.server import FETCHER, build_agent
from gateway.core.identity import scan_adapter, tree_digest
from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER, cold_salt
from gateway.dev.vllm_process import VllmProcess
from gateway.fleet.backends import fetch_model_list
from gateway.process.http_edge import running
from gateway.proof.experiment import complete, long_prompt
from gateway.table.epoch_table import EpochTable
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")
LOGICAL = "agent-tenant"
TOKEN = "agent-token"


async def test_a_replica_loads_the_version_its_agent_fetched_and_verified(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    session_redis: Redis,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    s3_url: str,
    tmp_path: Path,
) -> None:
    store = ObjectStore(s3_url)
    published = await publish_adapter(
        EpochTable(session_redis), store, LOGICAL, fixture_dir / "adapters" / "v1", "base"
    )
    async with AsyncExitStack() as stack:
        agents, fetchers = [], []
        for i, replica in enumerate(vllm_replicas):
            local = tmp_path / f"agent-{i}"
            app = build_agent(s3_url, local, token=TOKEN, replica_url=replica.url, agent_root=str(local),
                              disk_bytes=1 << 30)  # fmt: skip
            url = await stack.enter_async_context(running(app))
            agents.append(f"{replica.url}={url}|{local}")
            fetchers.append(app[FETCHER])
        gateway = await stack.enter_async_context(
            make_gateway(store=s3_url, replica_agents=agents, agent_token=TOKEN)
        )
        prompt = long_prompt()
        for i, replica in enumerate(vllm_replicas):
            local = tmp_path / f"agent-{i}" / published.digest
            pin = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
            first = await complete(http, gateway.url, LOGICAL, prompt, headers=pin)  # loads it there
            assert first.evidence["x-kvgate-digest"] == published.digest
            listed = (await fetch_model_list(http, replica.url)).adapters[published.name]
            assert listed == str(local), "vLLM loaded the agent's local copy"
            assert tree_digest(local, scan_adapter(local)) == published.digest, "and it holds the bytes"
            assert fetchers[i].counts["fetched"] == 1
            warm = await complete(http, gateway.url, LOGICAL, prompt, headers=pin)
            cold = await complete(http, replica.url, published.name, prompt, cache_salt=cold_salt())
            assert warm.cached_tokens >= 384, f"{replica.url}: the warm request must hit the prefix cache"
            assert cold.cached_tokens == 0
            assert warm.agrees_with(cold), f"{replica.url}: warm {warm.text!r} != cold {cold.text!r}"
        for replica in vllm_replicas:  # leave the session's replicas as other tests expect them
            async with http.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": published.name}):
                pass
        await asyncio.sleep(0)
