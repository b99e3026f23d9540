"""Issue 28's shape of a rollout: one tenant, one API key, one shared system prompt, no ``user`` field.
Started with the default split key, 300 conversations at 25% send 15-35% to the candidate, and each
conversation's second turn, sent through another ``kvgate serve`` process on the same Redis, keeps the
version its first turn had (the split is a pure function of the conversation and the rollout, the same in
every kvgate). Then a rollout split by API key: all of the tenant on one version. Stub replicas (the
split alone is under test; tests/vllm/test_rollout_vllm.py runs a rollout on real vLLM)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.process.http_edge import running
from gateway.table.callers import CallerTable
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.proof.test_rollouts import all_see, cli, gateway_process
from tests.support.adapter_files import MakeAdapter
from tests.support.stub_backend import StubState, build_stub

CONVERSATIONS = 300
SYSTEM = "You are the support assistant of a shop that sells bicycles; answer briefly and kindly. " * 8

Turn = list[ChatCompletionMessageParam]


def first_turn(i: int) -> Turn:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Order {1000 + i} has not arrived. Where is it?"}]  # fmt: skip


def second_turn(i: int) -> Turn:
    return [*first_turn(i), {"role": "assistant", "content": "Which address did you give?"},
            {"role": "user", "content": f"{i} Main Street."}]  # fmt: skip


async def versions(url: str, key: str, turns: dict[int, Turn]) -> dict[int, tuple[str, str]]:
    """Each conversation's turn through the kvgate at URL with the tenant's one key: (version, role)."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    seen: dict[int, tuple[str, str]] = {}
    queue = list(turns.items())

    async def worker() -> None:
        while queue:
            i, messages = queue.pop()
            raw = await api.chat.completions.with_raw_response.create(
                model="t", messages=messages, max_tokens=1
            )
            assert raw.parse().model == "t"
            seen[i] = (raw.headers["x-kvgate-version"], raw.headers.get("x-kvgate-rollout", ""))

    try:
        await asyncio.gather(*(worker() for _ in range(16)))
    finally:
        await api.close()
    return seen


@pytest.mark.timeout(300)
async def test_one_tenant_one_key_one_system_prompt_splits_its_conversations_across_kvgates(
    redis_server: EmbeddedRedis, table: EpochTable, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    v1 = await publish_adapter(table, store, "t", make_adapter(b"v1"), "base")
    key, _ = await CallerTable(table.redis).create("acme", ["t"], base=False)
    async with AsyncExitStack() as stack:
        stubs = [await stack.enter_async_context(running(build_stub(StubState()))) for _ in range(2)]
        a, b = [
            await stack.enter_async_context(gateway_process(redis_server, store, stubs, "--auth", "api-keys"))
            for _ in range(2)
        ]
        out = cli(redis_server, store, "rollout", "t", str(make_adapter(b"v2")), "--percent", "25")
        assert out.startswith("rollout started: t -> t@"), out
        assert "split by user" in out, "the default split key"
        v2_name = out.split(" -> ")[1].split()[0]
        await all_see([a, b], 2500)

        firsts = await versions(a, key, {i: first_turn(i) for i in range(CONVERSATIONS)})
        on_candidate = {i for i, (name, _) in firsts.items() if name == v2_name}
        assert {name for name, _ in firsts.values()} == {v1.name, v2_name}
        share = len(on_candidate) / CONVERSATIONS
        assert 0.15 <= share <= 0.35, f"candidate share {share:.1%} of {CONVERSATIONS} conversations"
        assert all(role == "candidate" for i, (_, role) in firsts.items() if i in on_candidate)

        seconds = await versions(b, key, {i: second_turn(i) for i in range(CONVERSATIONS)})
        moved = sorted(i for i in firsts if seconds[i] != firsts[i])
        assert moved == [], f"{len(moved)} conversations changed version on their second turn: {moved[:10]}"
        assert "split by user" in cli(redis_server, store, "status"), "kvgate status shows the split key"

        # the operator's other choice, per rollout: by API key, the tenant's one key is all or nothing
        assert cli(redis_server, store, "abort", "t").startswith("aborted: t rollout of ")
        out = cli(redis_server, store, "rollout", "t", str(make_adapter(b"v2")), "--percent", "50",
                  "--split-key", "api-key")  # fmt: skip
        assert "split by api-key" in out, out
        assert "split by api-key" in cli(redis_server, store, "versions", "t")
        await all_see([a, b], 5000)
        some = {i: second_turn(i) for i in range(50)}
        by_key = {*(await versions(a, key, some)).values(), *(await versions(b, key, some)).values()}
        assert len(by_key) == 1, f"one key, one version: {by_key}"
