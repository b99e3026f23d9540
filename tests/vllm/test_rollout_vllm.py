"""A rollout on the two real vLLM replicas (issue 22): at 50%, each answer (warm ones included) equals a
cold run of the version its headers name, on the replica that gave it; a candidate whose bytes differ
under its name on one replica fails the gate's audit and the rollout is aborted with no operator action.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.core.wire import ADMIN_TOKEN_HEADER, PIN_HEADER, cold_salt, replica_id
from gateway.dev.vllm_process import VllmProcess
from gateway.proof.experiment import Sample, complete, long_prompt
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import lora_adapter, swap_back, swap_bytes
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory, kvgate_json, post_json, run_kvgate

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]
FAST = {"reconcile_interval": 0.2, "poll_interval": 0.2, "drain_grace": 0.3}
USERS = [f"user-{i}" for i in range(12)]


async def status(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: ADMIN_TOKEN}) as response:
        doc: dict[str, Any] = await response.json()
        return doc


async def test_at_50_percent_every_answer_is_a_cold_run_of_the_version_its_headers_name(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    store, redis_url = tmp_path / "store", redis_server.url
    by_id = {replica_id(r.url): r for r in vllm_replicas}
    prompt = long_prompt()
    v1 = await kvgate_json(
        "publish", "ro", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    async with make_gateway(**FAST, rollout_gate_interval=0) as gateway:  # the gate's turn comes below
        v2 = await kvgate_json("rollout", "ro", str(fixture_dir / "adapters" / "v2"), "--percent", "50",
                               redis_url=redis_url, store=store)  # fmt: skip
        assert (v2["weight"], v2["epoch"]) == (5000, v1["epoch"] + 1)

        async def sees_it() -> bool:
            rollout = (await status(http, gateway.url))["versions"]["ro"]["rollout"]
            return rollout is not None and rollout["running"]

        await eventually(sees_it, "kvgate sees the rollout")
        answers: list[tuple[str, Sample]] = []
        for user in USERS:
            for _ in range(2):  # the second is a warm hit where the first ran
                answers.append(
                    (user, await complete(http, gateway.url, "ro", prompt, max_tokens=8, user=user))
                )
        roles = {sample.evidence["x-kvgate-rollout"] for _, sample in answers}
        assert roles == {"current", "candidate"}, "12 users at 50%: both versions answer"
        names = {"current": v1["name"], "candidate": v2["name"]}
        epochs = {"current": str(v1["epoch"]), "candidate": str(v2["epoch"])}
        per_user: dict[str, set[str]] = {}
        cold_of: dict[tuple[str, str], Sample] = {}
        for user, sample in answers:
            role, name = sample.evidence["x-kvgate-rollout"], sample.evidence["x-kvgate-version"]
            assert (name, sample.evidence["x-kvgate-epoch"]) == (names[role], epochs[role])
            per_user.setdefault(user, set()).add(name)
            replica = by_id[sample.evidence["x-kvgate-replica"]]
            if (replica.url, name) not in cold_of:
                cold_of[replica.url, name] = await complete(
                    http, replica.url, name, prompt, max_tokens=8, cache_salt=cold_salt()
                )
            cold = cold_of[replica.url, name]
            assert cold.cached_tokens == 0
            assert sample.agrees_with(cold), f"{user} on {replica.url}: {sample.text!r} != cold {cold.text!r}"
        assert all(len(names_) == 1 for names_ in per_user.values()), "each user stays on one version"
        assert any(sample.cached_tokens >= 384 for _, sample in answers), "warm hits were among them"
        texts = {
            name: {s.text for _, s in answers if s.evidence["x-kvgate-version"] == name}
            for name in names.values()
        }
        assert texts[v1["name"]].isdisjoint(texts[v2["name"]]), "the two versions answer differently"
    on_candidate = {by_id[s.evidence["x-kvgate-replica"]].url for _, s in answers
                    if s.evidence["x-kvgate-rollout"] == "candidate"}  # fmt: skip
    async with make_gateway(**FAST, rollout_gate_interval=0.5) as gateway:  # the gate over quiet replicas

        async def audited() -> bool:
            audits = (await status(http, gateway.url))["rollouts"].get("ro", {}).get("audits", {})
            return set(audits) >= on_candidate

        await eventually(audited, "the gate audits the candidate where it is loaded", 120)
        await asyncio.sleep(2.0)  # more rounds
        doc = await status(http, gateway.url)
        assert doc["versions"]["ro"]["rollout"]["running"], "the gate left a coherent candidate alone"
        assert doc["rollouts"]["ro"]["state"] == "watching"
        assert {a["verdict"] for a in doc["rollouts"]["ro"]["audits"].values()} == {"coherent"}


async def test_the_gate_aborts_a_candidate_that_fails_its_audit_with_no_operator_action(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    store, redis_url = tmp_path / "store", redis_server.url
    good, bad = vllm_replicas
    await kvgate_json(
        "publish", "gated", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    cand = await kvgate_json("rollout", "gated", str(fixture_dir / "adapters" / "v3"), "--percent", "100",
                             redis_url=redis_url, store=store)  # fmt: skip
    pin = {PIN_HEADER: good.url, ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
    async with make_gateway(**FAST, rollout_gate_interval=0) as loader:  # no gate yet
        first = await complete(http, loader.url, "gated", "p", max_tokens=1, headers=pin, user="u")
        assert first.evidence["x-kvgate-version"] == cand["name"], "the candidate, loaded on the good replica"
    path = Path(cand["path"])  # other bytes under the candidate's name and path on the bad replica
    saved = swap_bytes(path, fixture_dir / "adapters" / "v2")
    try:
        await post_json(
            http, f"{bad.url}/v1/load_lora_adapter", {"lora_name": cand["name"], "lora_path": cand["path"]}
        )
    finally:
        swap_back(path, saved)
    async with make_gateway(**FAST, rollout_gate_interval=0.5) as gateway:

        async def aborted() -> bool:
            return not (await status(http, gateway.url))["versions"]["gated"]["rollout"]["running"]

        await eventually(aborted, "the gate aborts the rollout by itself", within=180)
        doc = await status(http, gateway.url)
        last = doc["versions"]["gated"]["rollout"]["last"]
        assert last["outcome"] == "aborted"
        assert re.match(r"gate: (replica-mismatch|incoherent-on-warm-hit) on ", last["reason"]), last
        assert doc["rollouts"]["gated"]["state"] == "aborted"
        verdict = last["reason"].split()[1]
        aborts = {  # by (logical_id, reason): the ID's own label, or "other" when it is not in the top K
            tuple(s.labels.values()): s.value
            for m in gateway.metrics.registry.collect() if m.name == "kvgate_rollout_gate_aborts"
            for s in m.samples if s.name.endswith("_total")
        }  # fmt: skip
        assert list(aborts.values()) == [1.0], aborts
        assert next(iter(aborts))[1] == verdict
        after = await complete(http, gateway.url, "gated", "p", max_tokens=1, user="u")
        assert after.evidence["x-kvgate-version"] != cand["name"], "the current version serves it again"
    history = await kvgate_json("history", "gated", redis_url=redis_url, store=store)
    event = history["history"][0]
    assert (event["action"], event["reason"]) == ("abort", last["reason"])
    assert json.dumps(event)  # a plain JSON event, as kvgate history prints it


async def test_a_candidate_built_for_another_hidden_size_is_refused_against_the_real_base(
    vllm_replicas: list[VllmProcess], redis_server: EmbeddedRedis, fixture_dir: Path, tmp_path: Path
) -> None:
    """``kvgate rollout`` reads the base the real replicas list (its directory here) and refuses an adapter
    of hidden size 512 for the fixture's 256 in one line, before the store or the table is written
    (vLLM would load it and fail every request: ``size mismatch``)."""
    store, redis_url = tmp_path / "store", redis_server.url
    await kvgate_json(
        "publish", "misfit", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=store
    )
    stored = sorted(store.iterdir())
    wider = lora_adapter(tmp_path / "wider", hidden=512, layers=2, r=8)
    replicas = [arg for replica in vllm_replicas for arg in ("--replica", replica.url)]
    code, _, err = await run_kvgate(
        "rollout", "misfit", str(wider), "--percent", "25", *replicas, redis_url=redis_url, store=store
    )
    assert code == 2, err
    assert "the adapter does not fit base 'base'" in err, err
    assert "lora_A is 8x512, the base's model.layers.0.self_attn.q_proj is 256x256" in err, err
    assert sorted(store.iterdir()) == stored
    history = await kvgate_json("history", "misfit", redis_url=redis_url, store=store)
    assert [event["action"] for event in history["history"]] == ["publish"]
