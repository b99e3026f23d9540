"""Base fingerprints against stub backends (real Redis, the real kvgate app): eligibility by print, a base
swapped under a replica's name, several bases in one pool, and ``kvgate publish --base``.

The stub answers kvgate's probe from its ``weights``: changing them is another base under the same name.
The real-vLLM test (other weights in the same model directory) is tests/vllm/test_base_swap_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.cli.base_model import choose_base
from gateway.core import base_print
from gateway.core.model import Target, VersionState
from gateway.core.scheduler import eligible
from gateway.core.wire import cache_salt
from gateway.fleet.backends import VllmDialect
from gateway.fleet.base_bytes import BaseBytes
from gateway.fleet.replicas import ReplicaPool
from gateway.process.http_edge import free_port, running
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics
from tests.cli.test_cli import kvgate
from tests.fleet.test_base_bytes import make_base
from tests.fleet.test_replica_answers import fleet, poll
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "test-admin-token"


PROMPTS, K = len(base_print.PROBE_PROMPTS), base_print.TOP_K
PROBE = [-1.0 - 0.05 * p - 0.4 * r for p in range(PROMPTS) for r in range(K)]  # per prompt, top-K logprobs
FIRSTS = [f" w{p}" for p in range(PROMPTS)]  # per prompt, its first token


def run(values: list[float], firsts: list[str] = FIRSTS) -> list[list[tuple[str, float]]]:
    """One cold run of the probe: per prompt, its top-K (token, logprob), highest first."""
    return [
        sorted(
            [(firsts[p] if r == 0 else f" x{r}", values[p * K + r]) for r in range(K)], key=lambda t: -t[1]
        )
        for p in range(PROMPTS)
    ]


def printed(values: list[float], firsts: list[str] = FIRSTS, floor: float = 0.05) -> base_print.BasePrint:
    return base_print.take([run(values, firsts)], floor)


def noisy(values: list[float], seed: int, size: float) -> list[float]:
    """``values`` with every logprob moved by up to ``size`` (batching noise: a rounding step or a few)."""
    rng = random.Random(seed)
    return [x + rng.uniform(-size, size) for x in values]


def test_the_behaviour_rule_top_logprobs_within_the_calibrated_tolerance() -> None:
    one = base_print.take([run(PROBE), run(PROBE)], floor=0.05)
    assert one.tolerance == 0.05  # bit-exact cold runs: the floor decides
    assert base_print.decode(one.encode()) == one
    assert one.short.startswith("bp2-")
    assert not one.bytes
    calibrated = base_print.take([run(PROBE), run([x + 0.1 for x in PROBE])], floor=0.0)
    assert calibrated.tolerance == pytest.approx(0.2)  # 2 x the mean disagreement of its own cold runs
    assert not base_print.prints_match(one.encode(), None)
    assert base_print.prints_match("", None)
    assert base_print.decode("not-a-print") is None
    assert base_print.decode("bp2-0123456789abcdef:::") is None


def test_batching_noise_and_a_near_tie_flip_are_never_a_difference() -> None:
    """Noise far above the CPU build's rounding step (0.004) on every value stays within the floor, and a
    first token that flips where it was a near-tie (its top-2 0.01 behind) is not a difference."""
    one = printed(PROBE)
    for seed in range(200):
        again = base_print.take([run(noisy(PROBE, seed, 0.03)), run(noisy(PROBE, seed + 1000, 0.03))], 0.05)
        assert one.matches(again), seed
    tied = list(PROBE)
    tied[2 * K + 1] = tied[2 * K] - 0.01  # prompt 2: its top-2 is a near-tie
    flipped = list(FIRSTS)
    flipped[2] = " x1"  # ... and under load the other one comes first
    assert printed(tied).matches(printed(tied, flipped))


def test_a_clear_margin_flip_or_other_weights_are_another_base_by_behaviour() -> None:
    one = printed(PROBE)
    flipped = list(FIRSTS)
    flipped[5] = " y"  # prompt 5's first token differs though it led by 0.4: not a tie
    assert "neither is a near-tie" in (one.difference(printed(PROBE, flipped)) or "")
    other = printed(noisy([x - 0.3 for x in PROBE], 1, 0.2))
    assert "top logprobs differ" in (one.difference(other) or "")
    assert not base_print.prints_match(one.encode(), other.encode())


def test_the_bytes_decide_where_both_prints_have_them() -> None:
    same = "a" * 64
    one = replace(printed(PROBE), bytes=same)
    far = replace(printed([x - 1.0 for x in PROBE]), bytes=same)
    assert one.matches(far), "same bytes: one base, whatever the behaviour says"
    assert one.difference(far) is None
    swapped = replace(one, bytes="b" * 64)
    assert "base bytes differ" in (one.difference(swapped) or ""), "other bytes, same behaviour: another base"
    only_bytes = base_print.of_bytes(same)
    assert only_bytes.matches(one)
    assert base_print.decode(only_bytes.encode()) == only_bytes
    no_bytes = replace(far, bytes="")
    assert not one.matches(no_bytes), "without bytes on one side, the behaviour decides"
    assert not only_bytes.comparable(no_bytes)
    assert base_print.differs(only_bytes.encode(), no_bytes.encode()) is None, "cannot be told: no act"
    assert one.short == f"bp2-{same[:16]}" == far.short


def test_a_print_of_the_first_scheme_stays_readable_and_is_held_to_the_reference() -> None:
    legacy = "bp1-0123456789abcdef:0.010000:-0.500000,-0.250000"
    decoded = base_print.decode(legacy)
    assert decoded is not None
    assert decoded.legacy
    assert decoded.short == "bp1-0123456789abcdef"
    now = printed(PROBE).encode()
    assert not base_print.prints_match(legacy, now), "another probe: never compared"
    pool = ReplicaPool([], VllmDialect(), cast(aiohttp.ClientSession, None), base_with_root=False)
    old = VersionState("t", "d" * 64, "t@d", "/s/d", "base", 1, base_print=legacy)
    assert pool.expected_print(old) == ""
    pool.base_references["base"] = now
    assert pool.expected_print(old) == now
    assert cache_salt("g", old) != cache_salt("g", replace(old, base_print="")), "its namespace is kept"


class View:
    def __init__(self, url: str, base_print: str | None, base: str = "base") -> None:
        self.url, self.base, self.base_print = url, base, base_print
        self.healthy, self.in_flight, self.adapter_count = True, 0, 0
        self.adapters = {"t@d": "/s/d"}  # every view lists the version
        self.quarantined: dict[str, str] = {}
        self.unloading: set[str] = set()

    def root_for(self, path: str) -> str:
        return path


def test_a_replica_is_eligible_only_when_its_base_print_matches() -> None:
    p0 = printed(PROBE).encode()
    p1 = printed([x - 0.5 for x in PROBE]).encode()
    version = VersionState("t", "d" * 64, "t@d", "/s/d", "base", 1, base_print=p0)
    replicas = [View("a", p0), View("b", p1), View("c", None), View("d", p0, base="other")]
    target = Target("t", "base", version, cache_salt("g", version), [], version.base_print)
    assert [r.url for r in eligible(replicas, target)] == ["a"]
    legacy = Target("t", "base", version, None, [], "")
    assert [r.url for r in eligible(replicas, legacy)] == ["a", "b", "c"]
    unprinted = VersionState("t", "d" * 64, "t@d", "/s/d", "base", 1)
    assert cache_salt("g", unprinted) != cache_salt("g", version), "the print is in the cache namespace"


async def status(url: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/kvgate/status", headers={"x-kvgate-admin-token": TOKEN}) as response,
    ):
        doc: dict[str, Any] = await response.json()
        return doc


async def metric(url: str, line_start: str) -> float | None:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/metrics", headers={"x-kvgate-admin-token": TOKEN}) as response,
    ):
        for line in (await response.text()).splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return None


async def publish_for(
    table: EpochTable, store: AdapterStore, adapter: Path, replicas: list[str], base: str | None = None
) -> str:
    chosen = await choose_base(Settings(replicas=replicas, store=store.root), base)
    await publish_adapter(table, store, "tenant-42", adapter, chosen.identity, base_print=chosen.print)
    return chosen.print


async def metric_is(url: str, line_start: str, value: float) -> bool:
    return await metric(url, line_start) == value


class RestartableStub:
    """A stub replica on a fixed port that can be stopped and started again (a replica's restart)."""

    def __init__(self, state: StubState) -> None:
        self.state, self.port = state, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        await self.stack.enter_async_context(running(build_stub(self.state), "127.0.0.1", self.port))

    async def stop(self) -> None:
        await self.stack.aclose()


async def test_a_swapped_base_is_another_base_until_it_is_swapped_back(
    redis: Redis,
    redis_server: EmbeddedRedis,
    table: EpochTable,
    store: AdapterStore,
    make_adapter: MakeAdapter,
) -> None:
    a, b = StubState(), StubState()
    replica_a = RestartableStub(a)
    await replica_a.start()
    try:
        async with running(build_stub(b)) as url_b:
            await swap_and_back(redis, table, store, make_adapter, replica_a, url_b, b, redis_server.url)
    finally:
        await replica_a.stop()


async def swap_and_back(
    redis: Redis,
    table: EpochTable,
    store: AdapterStore,
    make_adapter: MakeAdapter,
    replica_a: RestartableStub,
    url_b: str,
    b: StubState,
    redis_url: str,
) -> None:
    a, url_a = replica_a.state, replica_a.url
    printed = await publish_for(table, store, make_adapter(b"v1"), [url_a, url_b])
    assert base_print.decode(printed) is not None
    settings = Settings(replicas=[url_a, url_b], store=store.root, admin_token=TOKEN,
                        reconcile_interval=0.1, poll_interval=0.1, drain_grace=0.2)  # fmt: skip
    metrics = Metrics()
    async with (
        running(build_app(settings, redis, metrics=metrics)) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
    ):
        for replica in (url_a, url_b):  # pinned, so that both replicas hold the version
            pin = {"x-kvgate-pin": replica, "x-kvgate-admin-token": TOKEN}
            await api.completions.create(model="tenant-42", prompt="x", max_tokens=1, extra_headers=pin)
        await eventually(lambda: bool(a.adapters) and bool(b.adapters), "loaded on both", 10)
        probes = a.probes

        async def restart_a(weights: int, *, keeps_adapters: bool = False) -> None:
            """Down for longer than a poll, then back (a server with static adapters keeps them)."""
            await replica_a.stop()
            a.weights = weights
            if not keeps_adapters:
                a.adapters = {}
            await eventually(a_seen_down, "seen down", 10)
            await replica_a.start()

        async def a_seen_down() -> bool:
            return not {r["url"]: r for r in (await status(url))["replicas"]}[url_a]["healthy"]

        async def a_is_another_base() -> bool:
            seen = {r["url"]: r for r in (await status(url))["replicas"]}[url_a]
            return bool(seen["healthy"]) and "tenant-42" in seen["base_mismatch"]

        await restart_a(1, keeps_adapters=True)  # other weights under the same name and root
        await eventually(a_is_another_base, "the swap reported", 10)
        await eventually(lambda: not a.adapters, "the old base's version unloaded there", 10)
        unloads = f'kvgate_adapter_unloads_total{{reason="base-mismatch",replica="{url_a}"}}'
        # the stub drops the adapter before kvgate has its answer and counts the unload
        await eventually(lambda: metric_is(url, unloads, 1.0), "the unload counted", 10)
        assert a.probes > probes, "the restart was fingerprinted again"
        seen = {r["url"]: r for r in (await status(url))["replicas"]}
        assert "top logprobs differ" in seen[url_a]["base_print_changed"]
        assert seen[url_a]["base_print_previous"] == base_print.short(printed)
        assert seen[url_b]["base_mismatch"] == {}
        assert await metric(url, f'kvgate_base_mismatched_versions{{replica="{url_a}"}}') == 1.0
        assert await metric(url, f'kvgate_base_print_changes_total{{replica="{url_a}"}}') == 1.0

        def cli_status_says_why() -> bool:
            done = kvgate("status", "--redis-url", redis_url, data_dir=store.root.parent / "cli")
            return f"OTHER BASE on {url_a}" in done.stdout and "logprobs differ" in done.stdout

        await eventually(lambda: asyncio.to_thread(cli_status_says_why), "kvgate status says why", 30)
        before = len(a.received)
        for _ in range(6):
            await api.completions.create(model="tenant-42", prompt="x", max_tokens=1)
        assert len(a.received) == before, "never routed there"
        assert not a.adapters, "never loaded there"

        await restart_a(0)  # back to the original weights

        async def a_serves_again() -> bool:
            pin = {"x-kvgate-pin": url_a, "x-kvgate-admin-token": TOKEN}
            try:
                await api.completions.create(model="tenant-42", prompt="x", max_tokens=1, extra_headers=pin)
            except openai.APIStatusError:
                return False
            return len(a.received) > before

        await eventually(a_serves_again, "eligible and routed there again", 10)
        assert await metric(url, f'kvgate_base_mismatched_versions{{replica="{url_a}"}}') == 0.0


async def test_several_bases_in_one_pool(
    redis: Redis, table: EpochTable, store: AdapterStore, make_adapter: MakeAdapter
) -> None:
    a, b = StubState(), StubState(base="other", base_root="/models/other", weights=7)
    async with running(build_stub(a)) as url_a, running(build_stub(b)) as url_b:
        await publish_for(table, store, make_adapter(b"v1"), [url_a, url_b], base="other")
        settings = Settings(replicas=[url_a, url_b], store=store.root, admin_token=TOKEN,
                            reconcile_interval=0.1, poll_interval=0.1)  # fmt: skip
        async with (
            running(build_app(settings, redis)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
        ):
            for _ in range(3):
                await api.completions.create(model="other", prompt="x", max_tokens=1)
                await api.completions.create(model="tenant-42", prompt="x", max_tokens=1)
            assert [body["model"] for body in a.received] == []
            assert {body["model"] for body in b.received} == {"other", next(iter(b.adapters))}
            models = {m.id: getattr(m, "parent", None) for m in (await api.models.list()).data}
            assert models == {"base": None, "other": None, "tenant-42": "other"}
            with pytest.raises(openai.NotFoundError):
                await api.completions.create(model="third", prompt="x", max_tokens=1)


async def test_publish_base_is_refused_when_several_are_served(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    a, b = StubState(), StubState(base="other", weights=3)
    async with running(build_stub(a)) as url_a, running(build_stub(b)) as url_b:
        replicas = ["--replica", url_a, "--replica", url_b]
        data = tmp_path / "kvgate"
        adapter = str(make_adapter(b"v1"))
        refused = await asyncio.to_thread(kvgate, "publish", "tenant-42", adapter, *replicas, data_dir=data)
        assert refused.returncode != 0
        assert "several bases (base, other): choose one with --base" in refused.stderr
        assert not (data / "store").exists(), "nothing stored"
        unknown = await asyncio.to_thread(
            kvgate, "publish", "tenant-42", adapter, *replicas, "--base", "third", data_dir=data
        )
        assert unknown.returncode != 0
        assert "no replica serves base 'third'" in unknown.stderr
        done = await asyncio.to_thread(
            kvgate, "publish", "tenant-42", adapter, *replicas, "--base", "other", "--json", data_dir=data
        )
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["base"] == "other"
        assert doc["base_print"].startswith("bp2-")
        b.weights = 4  # a second replica of "other" with other weights: the two disagree
        async with running(build_stub(StubState(base="other", weights=3))) as url_c:
            disagree = await asyncio.to_thread(
                kvgate, "publish", "tenant-42", adapter, "--replica", url_b, "--replica", url_c, data_dir=data
            )
        assert disagree.returncode != 0
        assert "have different fingerprints" in disagree.stderr


async def test_base_model_root_keeps_a_replica_of_another_root_apart(
    redis: Redis, table: EpochTable, store: AdapterStore, make_adapter: MakeAdapter
) -> None:
    """With ``base_model_root``, the root a replica lists is part of its base: publish takes the print of
    the replicas of that root only, and kvgate routes the version only there."""
    a, b = StubState(base_root="/models/a"), StubState(base_root="/models/b", weights=5)
    async with running(build_stub(a)) as url_a, running(build_stub(b)) as url_b:
        settings = Settings(replicas=[url_a, url_b], store=store.root, admin_token=TOKEN,
                            base_model_root="/models/b", poll_interval=0.1)  # fmt: skip
        chosen = await choose_base(settings, None)
        assert chosen.identity == "base=/models/b"
        await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), chosen.identity,
                              base_print=chosen.print)  # fmt: skip
        async with (
            running(build_app(settings, redis)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
        ):
            for _ in range(4):
                await api.completions.create(model="tenant-42", prompt="x", max_tokens=1)
            pin = {"x-kvgate-pin": url_a, "x-kvgate-admin-token": TOKEN}
            with pytest.raises(openai.APIStatusError) as refused:
                await api.completions.create(model="tenant-42", prompt="x", max_tokens=1, extra_headers=pin)
            assert refused.value.status_code == 503
    assert a.received == []
    assert len(b.received) == 4


async def test_one_odd_print_is_not_acted_on_a_confirmed_difference_is() -> None:
    """A restarted replica whose first print is odd (one probe under load) is probed again and keeps its
    base; one that keeps answering otherwise is another base after ``CONFIRM_PROBES`` prints, no sooner."""
    async with fleet(1) as ([replica], pool, prints):
        prints.confirm_wait = 0.0
        await poll(pool, prints)
        first, seen = pool.replicas[0].base_print, replica.state.probes
        assert first is not None

        replica.state.odd_probes = [1] * base_print.PROBE_RUNS  # one odd print, then its own weights again
        replica.state.started += 10.0  # it restarted
        await poll(pool, prints)
        assert replica.state.probes == seen + 2 * base_print.PROBE_RUNS, "the odd print was taken again"
        assert pool.replicas[0].base_print == first
        assert pool.replicas[0].prints.changed_reason == ""

        seen = replica.state.probes
        replica.state.weights = 1  # other weights for good
        replica.state.started += 10.0
        await poll(pool, prints)
        assert replica.state.probes == seen + base_print.CONFIRM_PROBES * base_print.PROBE_RUNS
        assert "top logprobs differ" in pool.replicas[0].prints.changed_reason
        assert base_print.differs(first, pool.replicas[0].base_print) is not None


async def test_replicas_whose_bytes_agree_are_one_base_and_a_behaviour_disagreement_is_reported(
    redis: Redis,
    redis_server: EmbeddedRedis,
    table: EpochTable,
    store: AdapterStore,
    make_adapter: MakeAdapter,
    tmp_path: Path,
) -> None:
    """Two replicas of one model directory whose probes disagree by far (as two replicas of one base under
    load did, 2026-12-03): publish is not refused, both serve the version, and the disagreement is on
    ``/kvgate/status`` (what differs), ``kvgate status`` and ``/healthz`` (a count only)."""
    model = make_base(tmp_path / "model", b"w" * 1000)
    a, b = StubState(), StubState(weights=3)
    async with running(build_stub(a)) as url_a, running(build_stub(b)) as url_b:
        settings = Settings(replicas=[url_a, url_b], store=store.root, admin_token=TOKEN, poll_interval=0.1,
                            base_model_dirs=[f"base={model}"], data_dir=tmp_path / "data")  # fmt: skip
        chosen = await choose_base(settings, None)
        decoded = base_print.decode(chosen.print)
        assert decoded is not None
        assert decoded.bytes == BaseBytes(None).digest(model)
        await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), chosen.identity,
                              base_print=chosen.print)  # fmt: skip
        async with (
            running(build_app(settings, redis)) as url,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as api,
        ):
            for replica in (url_a, url_b):
                pin = {"x-kvgate-pin": replica, "x-kvgate-admin-token": TOKEN}
                await api.completions.create(model="tenant-42", prompt="x", max_tokens=1, extra_headers=pin)

            async def reported() -> bool:
                return bool((await status(url))["base_disagreements"])

            await eventually(reported, "the disagreement on /kvgate/status", 10)
            [found] = (await status(url))["base_disagreements"]
            assert found["kind"] == "behaviour-only"
            assert found["replicas"] == [url_a, url_b]
            assert "the bytes agree" in found["detail"]
            assert "top logprobs differ" in found["detail"]
            async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as response:
                health = await response.json()
            assert health["base_disagreements"] == 1  # a count: which replicas is for the admin token
            replicas = {r["url"]: r for r in (await status(url))["replicas"]}
            assert replicas[url_a]["base_mismatch"] == {}
            assert replicas[url_b]["base_mismatch"] == {}

            def cli_says() -> bool:
                done = kvgate("status", "--redis-url", redis_server.url, data_dir=tmp_path / "cli")
                return "BASE PRINTS DISAGREE (behaviour-only)" in done.stdout

            await eventually(lambda: asyncio.to_thread(cli_says), "kvgate status says so", 30)
    assert a.loads, "a served the version"
    assert b.loads, "b served the version"


async def test_the_same_bytes_published_again_with_a_print_taken_again_change_nothing(
    table: EpochTable, store: AdapterStore, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(b"v1")
    first = printed(PROBE).encode()
    again = printed(noisy(PROBE, 7, 0.01)).encode()
    assert again != first
    done = await publish_adapter(table, store, "tenant-42", adapter, "base", base_print=first)
    same = await publish_adapter(table, store, "tenant-42", adapter, "base", base_print=again)
    assert not same.change.changed
    assert same.change.epoch == done.change.epoch
    other = printed([x - 0.5 for x in PROBE]).encode()
    swapped = await publish_adapter(table, store, "tenant-42", adapter, "base", base_print=other)
    assert swapped.change.changed, "another base: a new epoch"
    state = await table.read_state("tenant-42")
    assert state is not None
    assert state.base_print == other
