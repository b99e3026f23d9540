"""Precise prefix routing on the two real vLLM replicas, which publish their KV cache events
(``--kv-events-config`` in the session fixture): events arrive and decode, kvgate's tokens equal the
replica's ``/tokenize``, a second kvgate (a ``kvgate serve`` child process) routes a prompt warmed
through the first to the replica that holds it, with a cache hit, v1's blocks never count for v2, and a
replica restart empties its view (and it is learned again), an evicted prefix stops attracting requests.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import math
import os
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from gateway.core.errors import AuditError
from gateway.core.wire import (
    ADMIN_TOKEN_HEADER,
    PIN_HEADER,
    PREFIX_MATCH_HEADER,
    REPLICA_HEADER,
    VERSION_HEADER,
)
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, kv_events_args
from gateway.kv.indexer import PAGE_S
from gateway.kv.prompt_tokens import PromptTokens
from gateway.process.http_edge import free_port
from gateway.proof.experiment import complete, long_prompt
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, Gateway, GatewayFactory, kvgate_json
from tests.vllm.test_fleet_vllm import kvgate_process

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]
BLOCK = 128  # vLLM's KV block on the CPU build


def pin(replica: VllmProcess) -> dict[str, str]:
    return {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


def precise(fixture_dir: Path) -> dict[str, Any]:
    """Precise routing needs no setting (KV events followed by default, the tokenizer found in the root
    the replicas list, ``fixture_dir / "model"``); replicas named by URL in the evidence."""
    return {"expose_replica_urls": True}


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def prompt(tag: str) -> str:
    return f"Precise routing case {tag}. " + long_prompt(15)  # about 460 tokens: 3 full blocks


PROBES = itertools.count()
REPORTED_WITHIN_S = PAGE_S + 0.5
"""A probe's events show in a kvgate's counters within this once its KV indexer follows the replica (the
indexer writes its page every ``PAGE_S``): so many probes are not sent while the first is on its way."""


async def until_followed(
    http: aiohttp.ClientSession,
    url: str,
    replica: VllmProcess,
    stored: Callable[[], float | Awaitable[float]],
) -> int:
    """Wait until ``replica``'s events reach a follower (``stored``: its BlockStored count for the replica).
    ZMQ drops what a publisher sends before a SUB socket has joined, so until then a probe (a one-block
    prompt of its own) goes through the kvgate at ``url`` to the replica, and its events are looked for
    (``REPORTED_WITHIN_S``, before the next probe). Returns the number of probes sent (the blocks they
    left on the replica)."""

    async def count() -> float:
        seen = stored()
        return await seen if inspect.isawaitable(seen) else seen

    loop = asyncio.get_running_loop()
    before, sent, last = await count(), 0, -math.inf

    async def arrived() -> bool:
        nonlocal sent, last
        if await count() > before:
            return True
        if loop.time() - last < REPORTED_WITHIN_S:  # the last probe's events may not be counted yet
            return False
        probe = f"Probe {next(PROBES)}. " + long_prompt(5)  # about 160 tokens: one full block
        try:
            await complete(http, url, "base", probe, max_tokens=1, headers=pin(replica))
        except AuditError as exc:  # a replica just (re)started: kvgate's poller has not seen it healthy yet
            if "is unhealthy or does not serve base" not in exc.message:
                raise
            return False
        sent += 1
        last = loop.time()
        return False

    await eventually(arrived, f"{replica.url}'s KV events reach the follower", within=60)
    return sent


def stored_in(metrics: Metrics, replica: VllmProcess) -> Callable[[], float]:
    """The BlockStored events an in-process kvgate's follower of ``replica`` has seen."""
    return lambda: sample(metrics, "kvgate_kv_events_total", replica=replica.url, kind="BlockStored")


def blocks_of(metrics: Metrics, replica: VllmProcess) -> float:
    return sample(metrics, "kvgate_kv_view_blocks", replica=replica.url)


async def vllm_tokens(http: aiohttp.ClientSession, replica: VllmProcess, body: dict[str, Any]) -> list[int]:
    async with http.post(f"{replica.url}/tokenize", json={"model": "base", **body}) as response:
        assert response.status == 200, await response.text()
        tokens: list[int] = (await response.json())["tokens"]
        return tokens


async def test_gateway_tokens_equal_the_replicas_tokenize(
    vllm_replicas: list[VllmProcess], http: aiohttp.ClientSession, fixture_dir: Path
) -> None:
    tokens = PromptTokens.from_path(fixture_dir / "model")
    assert tokens.template is not None, "the fixture model has a chat template"
    text = prompt("tokenize") + "\n\nünïcode ✓, tabs\tand  double  spaces"
    assert tokens.completion({"prompt": text}) == array(
        "q", await vllm_tokens(http, vllm_replicas[0], {"prompt": text})
    )
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": text},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Again?"},
    ]
    for extra in ({}, {"add_generation_prompt": False}):
        body = {"messages": messages, **extra}
        assert tokens.chat(body) == array("q", await vllm_tokens(http, vllm_replicas[0], body)), extra


async def test_events_arrive_decode_and_a_version_never_counts_for_another(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    fixture_dir: Path,
) -> None:
    store, redis_url = tmp_path / "store", redis_server.url
    await kvgate_json(
        "publish", "precise-v", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    replica = vllm_replicas[0]
    text = prompt("versions")
    async with make_gateway(**precise(fixture_dir)) as gateway:
        metrics = gateway.metrics
        await eventually(
            lambda: sample(metrics, "kvgate_kv_view_blocks", replica=replica.url) == 0, "followed"
        )
        await until_followed(http, gateway.url, replica, stored_in(metrics, replica))
        probed = blocks_of(metrics, replica)
        cold = await complete(http, gateway.url, "precise-v", text, max_tokens=2, headers=pin(replica))
        assert cold.cached_tokens == 0
        await eventually(
            lambda: blocks_of(metrics, replica) >= probed + cold.prompt_tokens // BLOCK,
            "the replica's BlockStored events reached kvgate's view of it",
        )
        assert sample(metrics, "kvgate_kv_events_total", replica=replica.url, kind="BlockStored") >= 1
        assert sample(metrics, "kvgate_kv_events_malformed_total", replica=replica.url) == 0
        batches = {way: sample(metrics, "kvgate_kv_event_batches_total", replica=replica.url, read_in=way)
                   for way in ("c", "python")}  # fmt: skip
        assert batches["c"] >= 1, batches
        assert batches["python"] == 0, "vLLM's own batches are read in C, every one"
        async with http.get(
            f"{gateway.url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
        ) as response:
            shown = (await response.json())["kv_events"][replica.url]
        assert shown["blocks"] >= 3
        assert shown["events"] >= 1
        warm = await complete(http, gateway.url, "precise-v", text, max_tokens=2)
        assert warm.evidence[REPLICA_HEADER] == replica.url
        assert warm.cached_tokens >= 3 * BLOCK
        assert sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise") == 1

        # v2 of the same logical ID: v1's blocks are still on the replica, and count for nothing
        v2 = await kvgate_json(
            "publish", "precise-v", str(fixture_dir / "adapters" / "v2"), redis_url=redis_url, store=store
        )
        held = sample(metrics, "kvgate_kv_view_blocks", replica=replica.url)
        assert held >= 3, "v1's blocks are in the view when v2 is routed"

        async def on_v2() -> bool:
            short = await complete(
                http, gateway.url, "precise-v", "Which version?", max_tokens=1, headers=pin(replica)
            )
            return bool(short.evidence[VERSION_HEADER] == v2["name"])

        await eventually(on_v2, "kvgate serves v2", within=30)
        gateway.spans.clear()
        on_v2_warm = await complete(http, gateway.url, "precise-v", text, max_tokens=2)
        assert on_v2_warm.evidence[VERSION_HEADER] == v2["name"]
        assert on_v2_warm.cached_tokens == 0
        sources = [
            s.attributes.get("kvgate.prefix.source")
            for s in gateway.spans.get_finished_spans()
            if s.attributes
        ]
        assert "none" in sources
        assert "precise" not in sources
        assert sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise") == 1


async def test_a_second_kvgate_routes_prompts_warmed_through_the_first_to_their_replica(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    fixture_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28's first done-when line: with default settings (no routing setting, and B with its default
    workers, one per core), B sends each prompt warmed through A to the replica that holds it, with a
    cache hit: KV events are followed where published and the base's tokenizer is found by itself."""
    store, redis_url = tmp_path / "store", redis_server.url
    await kvgate_json(
        "publish", "precise-b", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    monkeypatch.setenv("KVGATE_EXPOSE_REPLICA_URLS", "true")  # B, a child process, reads it
    async with (
        make_gateway(**precise(fixture_dir)) as a,
        kvgate_process(vllm_replicas, redis_url, store, http) as (b, _),
    ):
        for replica in vllm_replicas:  # the version on both replicas: B has a choice to make
            await complete(
                http, a.url, "precise-b", prompt(f"load {replica.url}"), max_tokens=1, headers=pin(replica)
            )
        admin = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}

        async def b_sample(name: str, replica: VllmProcess, **labels: str) -> float:
            """One of B's samples for ``replica`` (0 when B has none yet), read off its ``/metrics``: its
            workers' merged page, with its KV indexer's series once."""
            async with http.get(f"{b}/metrics", headers=admin) as response:
                exposition = await response.text()
            wanted = {f'{k}="{v}"' for k, v in {"replica": replica.url, **labels}.items()}
            for line in exposition.splitlines():  # labels in any order (the workers' merged page)
                head, _, value = line.rpartition(" ")
                if head.startswith(name + "{") and wanted <= set(head[len(name) + 1 : -1].split(",")):
                    return float(value)
            return 0.0

        def b_stored(replica: VllmProcess) -> Awaitable[float]:
            return b_sample("kvgate_kv_events_total", replica, kind="BlockStored")

        for replica in vllm_replicas:  # B's KV indexer has joined: each event reaches it (once per kvgate)
            await until_b_follows(http, a, replica, functools.partial(b_stored, replica))
        a_before = {r.url: stored_in(a.metrics, r)() for r in vllm_replicas}
        b_before = {r.url: await b_stored(r) for r in vllm_replicas}
        prompts = {prompt(f"b{i}"): vllm_replicas[i % 2] for i in range(4)}
        for text, replica in prompts.items():  # warmed through A, each on one replica
            warmed = await complete(http, a.url, "precise-b", text, max_tokens=1, headers=pin(replica))
            assert warmed.cached_tokens == 0

        def a_learned() -> bool:
            return all(blocks_of(a.metrics, r) >= 6 for r in vllm_replicas)

        await eventually(a_learned, "A's views hold the blocks warmed through it", within=20)

        async def b_learned() -> bool:  # B's indexer got every event A got: every worker of B reads it
            for r in vllm_replicas:
                seen_by_a = stored_in(a.metrics, r)() - a_before[r.url]
                if seen_by_a <= 0 or await b_stored(r) - b_before[r.url] < seen_by_a:
                    return False
            return True

        await eventually(b_learned, "B's indexer got the events of the blocks warmed through A", within=20)
        for text, replica in prompts.items():
            through_b = await complete(http, b, "precise-b", text, max_tokens=1)
            assert through_b.evidence[REPLICA_HEADER] == replica.url, text[:40]
            assert through_b.cached_tokens >= 3 * BLOCK
            assert through_b.evidence[PREFIX_MATCH_HEADER] == "precise:3"
        async with http.get(f"{b}/metrics", headers=admin) as response:
            exposition = await response.text()
        assert 'kvgate_prefix_matched_blocks_count{source="precise"} 4.0' in exposition
        async with http.get(f"{b}/healthz", headers=admin) as response:
            health = await response.json()
        assert {s["routing"] for s in health["kv_events"].values()} == {"exact"}
        assert health["tokenizers"] == {"base": f"from {fixture_dir / 'model'}"}


async def until_b_follows(
    http: aiohttp.ClientSession, a: Gateway, replica: VllmProcess, b_stored: Callable[[], Awaitable[float]]
) -> None:
    """Wait until B's KV indexer (one per kvgate, whatever its workers) gets ``replica``'s events: a probe
    through A, until what B counted since the probe before it is what A counted (A in this process has
    joined first: ``until_followed``). ZMQ drops what is sent before a SUB socket joins."""
    await until_followed(http, a.url, replica, stored_in(a.metrics, replica))
    mark: tuple[float, float] | None = None

    async def joined() -> bool:
        nonlocal mark
        a_now, b_now = stored_in(a.metrics, replica)(), await b_stored()
        if mark is not None and a_now > mark[0] and b_now - mark[1] >= a_now - mark[0]:
            return True
        if mark is None or a_now > mark[0]:  # the last probe reached A: send the next one
            mark = (a_now, b_now)
            probe = f"Probe {next(PROBES)}. " + long_prompt(5)  # about 160 tokens: one full block
            await complete(http, a.url, "base", probe, max_tokens=1, headers=pin(replica))
        return False

    await eventually(joined, f"B's KV indexer follows {replica.url}'s KV events", within=60)


async def test_a_replica_restart_empties_its_view_and_it_is_learned_again(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
) -> None:
    index = 1
    replica = vllm_replicas[index]
    text = prompt("restart")
    async with make_gateway(**precise(fixture_dir)) as gateway:
        metrics = gateway.metrics
        await until_followed(http, gateway.url, replica, stored_in(metrics, replica))
        probed = blocks_of(metrics, replica)
        await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(replica))
        await eventually(lambda: blocks_of(metrics, replica) >= probed + 3, "learned")
        await replica.stop()
        restarted = VllmProcess(replica.spec)
        vllm_replicas[index] = restarted  # the session fixture stops it at the end
        await restarted.start()
        await eventually(
            lambda: sample(metrics, "kvgate_kv_view_blocks", replica=replica.url) == 0,
            "the view is emptied",
            within=30,
        )
        resets = sum(
            sample(metrics, "kvgate_kv_view_resets_total", replica=replica.url, reason=reason)
            for reason in ("replica restarted", "publisher restarted", "stream lost", "events lost")
        )
        assert resets >= 1
        await until_followed(http, gateway.url, restarted, stored_in(metrics, restarted))
        probed = blocks_of(metrics, restarted)
        again = await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(restarted))
        assert again.cached_tokens == 0  # the restart really emptied the replica's cache
        await eventually(lambda: blocks_of(metrics, restarted) >= probed + 3, "learned again")


async def test_a_purge_kvgate_made_empties_the_view_at_once_and_stops_attracting_requests(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    fixture_dir: Path,
) -> None:
    store, redis_url = tmp_path / "store", redis_server.url
    await kvgate_json(
        "publish", "precise-p", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    replica, text = vllm_replicas[0], prompt("purge")
    async with make_gateway(**precise(fixture_dir), invalidation="purge-all") as gateway:
        metrics = gateway.metrics
        await until_followed(http, gateway.url, replica, stored_in(metrics, replica))
        probed = blocks_of(metrics, replica)
        await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(replica))
        await eventually(lambda: blocks_of(metrics, replica) >= probed + 3, "learned")
        assert (await complete(http, gateway.url, "base", text, max_tokens=1)).cached_tokens >= 3 * BLOCK
        await kvgate_json(
            "publish", "precise-p", str(fixture_dir / "adapters" / "v2"), redis_url=redis_url, store=store
        )  # an epoch change: purge-all resets every replica's prefix cache
        await eventually(
            lambda: (
                sample(metrics, "kvgate_kv_view_resets_total", replica=replica.url, reason="purged by kvgate")
                >= 1
            ),
            "kvgate's purge emptied its view of the replica",
            within=30,
        )
        assert sample(metrics, "kvgate_kv_view_blocks", replica=replica.url) == 0
        precise_before = sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise")
        after = await complete(http, gateway.url, "base", text, max_tokens=1)
        assert after.cached_tokens == 0  # the purge was real
        assert sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise") == precise_before


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_replica(
    fixture_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmProcess]:
    """A third real replica whose KV cache holds 16 blocks, so a few prompts evict a earlier one's."""
    python = Path(os.environ["KVGATE_VLLM_PYTHON"])
    log = tmp_path_factory.mktemp("vllm-small") / "small.log"
    args = (*kv_events_args(), "--num-gpu-blocks-override", "16")
    replica = VllmProcess(VllmReplicaSpec(python, fixture_dir / "model", free_port(), log, extra_args=args))
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()


async def test_an_evicted_prefix_stops_attracting_requests(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    small_replica: VllmProcess,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
) -> None:
    replicas = [small_replica.url, vllm_replicas[0].url]
    text = prompt("evicted")
    # the predicted index off (0 entries): only the replicas' events can attract a request
    async with make_gateway(**precise(fixture_dir), replicas=replicas, prefix_index_entries=0) as gateway:
        metrics = gateway.metrics
        probes = await until_followed(http, gateway.url, small_replica, stored_in(metrics, small_replica))
        probed = blocks_of(metrics, small_replica)
        await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(small_replica))
        await eventually(lambda: blocks_of(metrics, small_replica) >= probed + 3, "learned")
        detail = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}  # each stream, named by replica: /healthz's detail view
        async with http.get(f"{gateway.url}/healthz", headers=detail) as response:
            followed = (await response.json())["kv_events"][small_replica.url]  # named by URL: exposed here
        assert (followed["state"], followed["blocks"] >= 3) == ("following", True)
        attracted = await complete(http, gateway.url, "base", text, max_tokens=1)
        assert attracted.evidence[REPLICA_HEADER] == small_replica.url
        assert attracted.evidence[PREFIX_MATCH_HEADER] == "precise:3"
        assert attracted.cached_tokens >= 3 * BLOCK

        def removed() -> float:
            return sample(metrics, "kvgate_kv_events_total", replica=small_replica.url, kind="BlockRemoved")

        # What the replica holds now is evicted first (least recently used): the view's blocks, and at most
        # one a probe whose events were dropped (sent before the SUB socket joined). The fillers store 24
        # blocks in a cache of 16: every one of those is evicted, and reported after it.
        evicted = removed() + blocks_of(metrics, small_replica) + max(0, probes - probed)
        for i in range(8):  # 8 prompts of 4 blocks through a 16-block cache: the first prompt's are evicted
            await complete(
                http, gateway.url, "base", prompt(f"filler {i}"), max_tokens=1, headers=pin(small_replica)
            )
        await eventually(lambda: removed() >= evicted, "the replica reported every older block evicted", 20)
        after = await complete(http, gateway.url, "base", text, max_tokens=1)
        assert after.evidence[PREFIX_MATCH_HEADER] == "none:0"  # nothing attracts it any more...
        assert after.cached_tokens == 0  # ...and nothing held it: the eviction was real
