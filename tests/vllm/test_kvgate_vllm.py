"""The same steps through kvgate, two real vLLM replicas, real Redis, the official openai client.

v1 is published (through the ``kvgate`` CLI) and warmed on both replicas; v2 is published under the
same logical ID. On every replica the warm answer then equals a cold run of v2 exactly, and no
response after the switch carries v1. v1 is unloaded once the drain grace has passed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER, cold_salt, replica_id
from gateway.dev.vllm_process import VllmProcess
from gateway.fleet.backends import fetch_model_list
from gateway.proof.experiment import Sample, complete, long_prompt
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, Gateway, kvgate_json, until_serves

pytestmark = pytest.mark.asyncio(loop_scope="session")
LOGICAL = "tenant-42"


def pin(replica: VllmProcess) -> dict[str, str]:
    return {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


async def test_new_version_is_coherent_on_every_replica(
    gateway: Gateway,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
) -> None:
    url, store, redis_url = gateway.url, gateway.store, redis_server.url
    prompt = long_prompt()
    v1 = await kvgate_json(
        "publish", LOGICAL, str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    await until_serves(http, url, LOGICAL, name=v1["name"])

    before: list[Sample] = []
    for replica in vllm_replicas:  # warm v1 on both replicas
        for _ in range(2):
            before.append(await complete(http, url, LOGICAL, prompt, headers=pin(replica)))
    assert {s.evidence["x-kvgate-version"] for s in before} == {v1["name"]}
    assert [s.evidence["x-kvgate-replica"] for s in before] == [
        replica_id(r.url) for r in vllm_replicas for _ in range(2)
    ]
    assert before[1].cached_tokens >= 384
    assert before[3].cached_tokens >= 384

    v2 = await kvgate_json(
        "publish", LOGICAL, str(fixture_dir / "adapters" / "v2"), redis_url=redis_url, store=store
    )
    assert (v2["epoch"], v2["changed"]) == (2, True)
    assert v2["path"].startswith(str(store))
    assert v2["digest"] != v1["digest"]
    await until_serves(http, url, LOGICAL, name=v2["name"])  # the hint (or a reconcile) reaches the snapshot

    after: list[Sample] = []
    for replica in vllm_replicas:
        after.append(await complete(http, url, LOGICAL, prompt, headers=pin(replica)))  # loads v2 there
        warm = await complete(http, url, LOGICAL, prompt, headers=pin(replica))
        cold = await complete(http, replica.url, v2["name"], prompt, cache_salt=cold_salt())
        after.append(warm)
        assert warm.cached_tokens >= 384, f"{replica.url}: the warm v2 request must hit the prefix cache"
        assert cold.cached_tokens == 0
        assert warm.agrees_with(cold), f"{replica.url}: warm {warm.text!r} != cold {cold.text!r}"
        assert warm.text != before[-1].text, "v2 must answer differently from v1"
        assert (await fetch_model_list(http, replica.url)).adapters[v2["name"]] == v2["path"]

    headers = await openai_traffic(url, prompt)
    served = [s.evidence["x-kvgate-version"] for s in after] + [h["x-kvgate-version"] for h in headers]
    assert set(served) == {v2["name"]}, "no response after the switch may carry v1"
    assert {s.model for s in after} == {LOGICAL}

    async def v1_unloaded() -> bool:
        loaded = [(await fetch_model_list(http, replica.url)).adapters for replica in vllm_replicas]
        return all(v1["name"] not in names and v2["name"] in names for names in loaded)

    await eventually(v1_unloaded, "drain grace 1 s, then the sweeper unloads v1 everywhere")

    status = await kvgate_json("status", redis_url=redis_url, store=store)
    (row,) = status["logical_ids"]
    assert (row["logical_id"], row["digest"], row["epoch"]) == (LOGICAL, v2["digest"], 2)
    assert row["loaded_on"] == sorted(replica.url for replica in vllm_replicas)


async def openai_traffic(url: str, prompt: str) -> list[Any]:
    """Non-streaming, streaming and chat requests with the official client; returns response headers."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        plain = await client.completions.with_raw_response.create(
            model=LOGICAL, prompt=prompt, max_tokens=4, temperature=0
        )
        assert plain.parse().model == LOGICAL
        assert (plain.parse().usage.prompt_tokens_details.cached_tokens or 0) >= 384  # type: ignore[union-attr]

        streamed = await client.completions.with_raw_response.create(
            model=LOGICAL, prompt=prompt, max_tokens=4, temperature=0, stream=True
        )
        chunks = [chunk async for chunk in streamed.parse()]
        assert chunks
        assert {chunk.model for chunk in chunks} == {LOGICAL}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.parse().choices[0].text

        chat = await client.chat.completions.with_raw_response.create(
            model=LOGICAL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4, stream=True
        )
        chat_chunks = [chunk async for chunk in chat.parse()]
        assert chat_chunks
        assert {chunk.model for chunk in chat_chunks} == {LOGICAL}
    return [plain.headers, streamed.headers, chat.headers]
