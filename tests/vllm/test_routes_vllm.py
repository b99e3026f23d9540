"""vLLM's tokenizer routes and ``/v1/models/{id}`` through kvgate on the real replicas, for a logical ID:
each answer is vLLM's own for that version (asked directly, by its versioned name), under the logical ID,
and the versioned name never shows. (Every other route is tested against the stub in
``tests/request/test_routes.py``: the tiny model serves neither pooling nor audio.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.wire import replica_id
from gateway.dev.vllm_process import VllmProcess
from gateway.table.epoch_table import EpochTable
from tests.support.conditions import eventually
from tests.vllm.conftest import Gateway

pytestmark = pytest.mark.asyncio(loop_scope="session")
LOGICAL = "routes-7"
PROMPT = "kvgate passes vLLM's tokenizer through"


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    async with http.post(url, json=body) as response:
        payload = await response.read()
        assert response.status == 200, f"{url} answered {response.status}: {payload!r}"
        return payload, dict(response.headers)


def stable(card: dict[str, Any]) -> dict[str, Any]:
    """A model card without what vLLM makes anew for each listing (times, permission ids) and the
    fields kvgate renames (id, and root: the store path)."""
    fresh = ("id", "root", "created")
    permission = [{k: v for k, v in p.items() if k not in fresh} for p in card.get("permission", [])]
    return {**{k: v for k, v in card.items() if k not in fresh}, "permission": permission}


async def test_tokenize_detokenize_and_model_card_are_vllms_own_under_the_logical_id(
    gateway: Gateway,
    vllm_replicas: list[VllmProcess],
    session_redis: Redis,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
) -> None:
    table = EpochTable(session_redis)
    published = await publish_adapter(
        table, AdapterStore(gateway.store), LOGICAL, fixture_dir / "adapters" / "v1", "base"
    )
    name = published.name

    async def listed() -> bool:
        async with http.get(f"{gateway.url}/v1/models") as listing:
            return LOGICAL in {card["id"] for card in (await listing.json())["data"]}

    await eventually(listed, f"kvgate's snapshot shows {LOGICAL}")
    replica_of = {replica_id(r.url): r.url for r in vllm_replicas}

    tokenized, evidence = await post(http, f"{gateway.url}/tokenize", {"model": LOGICAL, "prompt": PROMPT})
    replica = replica_of[evidence["x-kvgate-replica"]]
    direct, _ = await post(http, f"{replica}/tokenize", {"model": name, "prompt": PROMPT})
    assert evidence["x-kvgate-version"] == name
    assert json.loads(tokenized) == json.loads(direct)
    assert name.encode() not in tokenized
    tokens = json.loads(tokenized)["tokens"]
    assert len(tokens) > 3

    detokenized, evidence = await post(
        http, f"{gateway.url}/detokenize", {"model": LOGICAL, "tokens": tokens}
    )
    direct, _ = await post(
        http, f"{replica_of[evidence['x-kvgate-replica']]}/detokenize", {"model": name, "tokens": tokens}
    )
    assert json.loads(detokenized) == json.loads(direct)
    assert json.loads(detokenized)["prompt"].endswith(PROMPT)  # after the tokenizer's BOS

    without_model, _ = await post(http, f"{gateway.url}/tokenize", {"prompt": PROMPT})
    base_direct, _ = await post(http, f"{vllm_replicas[0].url}/tokenize", {"prompt": PROMPT})
    assert json.loads(without_model) == json.loads(base_direct), "no model: the base model, as in vLLM"

    async with (
        openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as api,
        http.get(f"{gateway.url}/v1/models/{LOGICAL}") as raw,
    ):
        card = await api.models.retrieve(LOGICAL)
        raw_card = await raw.read()
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve(name)  # a versioned name is never a model a client can name
    async with http.get(f"{replica_of[raw.headers['x-kvgate-replica']]}/v1/models") as listing:
        own = next(c for c in (await listing.json())["data"] if c["id"] == name)
    assert card.id == LOGICAL
    assert name.encode() not in raw_card
    through = json.loads(raw_card)
    assert stable(through) == stable(own), "vLLM's card for the version, but for its name"
    assert through["parent"] == "base"
    assert through["root"] == LOGICAL, "the store path stays kvgate's"
