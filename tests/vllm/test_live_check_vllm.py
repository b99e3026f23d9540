"""The live check on the two real vLLM replicas (issue 28, item 3): given another tokenizer than the
replicas' (the fixture's with its BPE merges taken out: every byte a token), kvgate's token counts
disagree with every answer's ``usage.prompt_tokens``, each replica drops to predicted routing with the
reason on ``/healthz``, and a prompt its events say it holds is routed on the predicted index; given the
right one, completions, chats and a streamed answer agree, both replicas stay exact, and a warmed prompt's
precise claim is confirmed by the answer's ``cached_tokens`` (the precision counters move together).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.core.wire import ADMIN_TOKEN_HEADER, PREFIX_MATCH_HEADER, REPLICA_HEADER
from gateway.dev.vllm_process import VllmProcess
from gateway.kv.live_check import MIN_CHECKED
from gateway.proof.experiment import complete
from gateway.telemetry.metrics import Metrics
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory
from tests.vllm.test_precise_vllm import (
    BLOCK,
    blocks_of,
    pin,
    prompt,
    sample,
    stored_in,
    until_followed,
    vllm_tokens,
)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]
DETAIL = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}


def byte_tokenizer(fixture_dir: Path, into: Path) -> Path:
    """The fixture model's tokenizer files, its ``tokenizer.json`` without BPE merges: the same bytes
    and special tokens, a different vocabulary in use (every byte a token)."""
    into.mkdir()
    for file in (fixture_dir / "model").iterdir():
        if file.suffix in (".json", ".jinja") and file.name not in ("config.json", "generation_config.json"):
            shutil.copy(file, into / file.name)
    doc = json.loads((into / "tokenizer.json").read_text())
    assert doc["model"]["type"] == "BPE", "the fixture's tokenizer is a BPE"
    assert doc["model"]["merges"], "the fixture's tokenizer merges"
    doc["model"]["merges"] = []
    (into / "tokenizer.json").write_text(json.dumps(doc))
    return into


def checks(metrics: Metrics, replica: VllmProcess, result: str) -> float:
    """``kvgate_token_checks_total`` of ``replica`` with ``result``, over every base label."""
    total = 0.0
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "kvgate_token_checks_total" and s.labels.get("replica") == replica.url:
                total += s.value if s.labels.get("result") == result else 0.0
    return total


async def healthz(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    async with http.get(f"{url}/healthz", headers=headers) as response:
        return await response.json()


async def post(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, str], str]:
    sent = {"model": "base", "max_tokens": 1, **body}
    async with http.post(f"{url}{path}", json=sent, headers=headers) as response:
        text = await response.text()
        assert response.status == 200, text
        return dict(response.headers), text


async def token_ids_prompt(http: aiohttp.ClientSession, replica: VllmProcess, tag: str) -> list[int]:
    """A prompt as token ids (the replica's own): kvgate keys it by the client's ids, no tokenizer."""
    return await vllm_tokens(http, replica, {"prompt": prompt(tag)})


async def test_another_tokenizer_drops_each_replica_to_predicted_routing_with_the_reason(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    wrong = byte_tokenizer(fixture_dir, tmp_path / "bytes")
    settings = {"kv_events": True, "tokenizer": wrong, "expose_replica_urls": True}
    first = vllm_replicas[0]
    async with make_gateway(**settings) as gateway:
        metrics = gateway.metrics
        for replica in vllm_replicas:  # a probe or two each (text: checked), fewer than are judged
            probes = await until_followed(http, gateway.url, replica, stored_in(metrics, replica))
            assert probes < MIN_CHECKED
        ids = await token_ids_prompt(http, first, "wrong tokenizer ids")
        probed = blocks_of(metrics, first)
        await post(http, gateway.url, "/v1/completions", {"prompt": ids}, pin(first))  # held by events
        await eventually(lambda: blocks_of(metrics, first) >= probed + 3, "the warmed ids are learned")
        headers, _ = await post(http, gateway.url, "/v1/completions", {"prompt": ids}, {})
        assert headers[PREFIX_MATCH_HEADER] == "precise:3", "before the check has judged: its events route"
        assert headers[REPLICA_HEADER] == first.url
        for replica in vllm_replicas:
            for i in range(MIN_CHECKED):
                text = f"Checked live, case {i} on {replica.url}: a short prompt of a few words."
                sent = await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(replica))
                assert sent.prompt_tokens > 0
        detail = (await healthz(http, gateway.url, DETAIL))["kv_events"]
        for replica in vllm_replicas:
            shown = detail[replica.url]
            assert shown["state"] == "following", shown
            assert shown["routing"] == "predicted", shown
            assert "token counts disagree" in shown["routing_reason"], shown
            assert shown["token_check"]["fallback"] is True
            assert shown["token_check"]["mismatched"] == shown["token_check"]["checked"] >= MIN_CHECKED
            assert checks(metrics, replica, "mismatch") >= MIN_CHECKED
            assert checks(metrics, replica, "match") == 0
            assert sample(metrics, "kvgate_token_check_fallback", replica=replica.url) == 1
        public = (await healthz(http, gateway.url))["kv_events"]
        assert public["token_fallback"] == 2
        assert "routing_reason" not in json.dumps(public)  # the public view counts, it names no replica

        # The ids prompt, held by the first replica's events (keyed by the client's ids, so a match there
        # would be real): its events no longer route it. A base request has no predicted keys: by load.
        precise_before = sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise")
        headers, _ = await post(http, gateway.url, "/v1/completions", {"prompt": ids}, {})
        assert headers[PREFIX_MATCH_HEADER] == "none:0"
        assert sample(metrics, "kvgate_prefix_matched_blocks_count", source="precise") == precise_before


async def test_the_right_tokenizer_agrees_stays_exact_and_a_warm_claim_is_confirmed(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
) -> None:
    settings = {"kv_events": True, "tokenizer": fixture_dir / "model", "expose_replica_urls": True}
    warm = vllm_replicas[1]
    async with make_gateway(**settings) as gateway:
        metrics = gateway.metrics
        for replica in vllm_replicas:
            await until_followed(http, gateway.url, replica, stored_in(metrics, replica))
        for replica in vllm_replicas:
            for i in range(MIN_CHECKED - 2):
                text = f"Checked live, case {i} on {replica.url}: ünïcode ✓ and  double  spaces."
                await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(replica))
            messages = [
                {"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": f"Which replica? {replica.url}"},
            ]
            await post(http, gateway.url, "/v1/chat/completions", {"messages": messages}, pin(replica))
            streamed = {"prompt": f"Streamed to {replica.url}", "stream": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
            _, text = await post(http, gateway.url, "/v1/completions", streamed, pin(replica))
            assert '"prompt_tokens"' in text
        detail = (await healthz(http, gateway.url, DETAIL))["kv_events"]
        for replica in vllm_replicas:
            shown = detail[replica.url]
            assert (shown["state"], shown["routing"]) == ("following", "exact"), shown
            assert "routing_reason" not in shown
            assert shown["token_check"]["mismatched"] == 0
            assert shown["token_check"]["fallback"] is False
            assert shown["token_check"]["checked"] >= MIN_CHECKED  # the probes of until_followed too
            assert checks(metrics, replica, "match") >= MIN_CHECKED
            assert checks(metrics, replica, "mismatch") == 0
        assert (await healthz(http, gateway.url))["kv_events"]["token_fallback"] == 0

        # A warmed prompt: the precise decision claims 3 blocks there, and the answer confirms them
        text = prompt("live check warm")
        probed = blocks_of(metrics, warm)
        await complete(http, gateway.url, "base", text, max_tokens=1, headers=pin(warm))
        await eventually(lambda: blocks_of(metrics, warm) >= probed + 3, "the warmed prompt is learned")
        claimed = sample(metrics, "kvgate_prefix_claimed_tokens_total", replica=warm.url)
        confirmed = sample(metrics, "kvgate_prefix_confirmed_tokens_total", replica=warm.url)
        again = await complete(http, gateway.url, "base", text, max_tokens=1)
        assert again.evidence[REPLICA_HEADER] == warm.url
        assert again.evidence[PREFIX_MATCH_HEADER] == "precise:3"
        assert again.cached_tokens >= 3 * BLOCK
        assert sample(metrics, "kvgate_prefix_claimed_tokens_total", replica=warm.url) == claimed + 3 * BLOCK
        assert sample(metrics, "kvgate_prefix_confirmed_tokens_total", replica=warm.url) == (
            confirmed + 3 * BLOCK
        )
        admin = {ADMIN_TOKEN_HEADER: ADMIN_TOKEN}
        async with http.get(f"{gateway.url}/metrics", headers=admin) as response:
            exposition = await response.text()
        assert f'kvgate_prefix_confirmed_tokens_total{{replica="{warm.url}"}}' in exposition
