"""Two real vLLM replicas of one model directory are one base, under concurrent load, on behaviour alone.

The session's two replicas serve the same directory. Load runs on both (base completions of mixed lengths,
straight to the replicas) the whole time: behaviour prints
taken while it runs all match; ``kvgate publish`` under it is not refused; a kvgate started under it
serves the tenant on both replicas within ``SERVES_WITHIN_S``, and so does a kvgate restarted under it;
a replica restarted under it (same directory, same port) serves the tenant again within that bound of
answering, with no disagreement.
kvgate is given a model directory it cannot read (``base_model_dirs``), so the bytes never decide here:
the behaviour print alone must be robust (where bytes can be read they decide; the bytes case and a real
swap are tests/vllm/test_base_swap_vllm.py).

The 2026-12-03 run with greedy-text prints got two prints of these replicas, a refused publish and 503
"no healthy replica serves base 'base' with fingerprint ..." for nearly every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from gateway.core import base_print
from gateway.dev.vllm_process import VllmProcess
from gateway.fleet.backends import VllmDialect
from gateway.fleet.base_prints import probe
from gateway.settings.model import Settings
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory, kvgate_json

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]

SERVES_WITHIN_S = 60.0
"""A kvgate started (or restarted) under load serves every version on both replicas within this: one
poll, two cold probes per replica and, for a print that differs, the confirming ones (docs/architecture.md
states the same bound)."""
PRINTS_EACH = 4  # behaviour prints taken of each replica under load
CLIENTS = 8  # concurrent base-model clients on the replicas
WORDS = ["boat", "tide", "harbor", "gull", "net", "lamp", "engineer", "ledger", "quiet", "evening"]
UNREADABLE = "base=/nonexistent/kvgate-base"  # kvgate cannot read the bytes: the behaviour decides


@contextlib.asynccontextmanager
async def base_load(
    http: aiohttp.ClientSession, urls: list[str], stopping: set[str]
) -> AsyncIterator[list[int]]:
    """Greedy base completions of 5-300 words, ``CLIENTS`` at a time, spread over ``urls``, until the
    block ends; yields the count of answers so far (a list of one, so that it moves). A replica in
    ``stopping`` (the last phase) may answer 500: vLLM 0.32 refuses what arrives as it shuts down, with
    "cannot schedule new futures after shutdown" or "EngineCore encountered an issue" (its engine process
    stopped first), both seen in full runs."""
    answered = [0]

    async def client(url: str, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))
            body = {"model": "base", "prompt": prompt, "max_tokens": 16, "temperature": 0}
            try:
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    text = await response.text()
                    if response.status == 500 and url in stopping:
                        continue
                    assert response.status == 200, text
                    answered[0] += 1
            except aiohttp.ClientConnectionError:  # its replica is restarting (the last phase): retry
                await asyncio.sleep(0.5)

    tasks = [asyncio.create_task(client(url, i)) for i, url in zip(range(CLIENTS), itertools.cycle(urls))]
    try:
        yield answered
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def tenant_served_on(http: aiohttp.ClientSession, gateway: str, replica: str) -> bool:
    body = {"model": "tenant-42", "prompt": "The harbor master", "max_tokens": 2, "temperature": 0}
    headers = {"x-kvgate-pin": replica, "x-kvgate-admin-token": ADMIN_TOKEN}
    async with http.post(f"{gateway}/v1/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status == 200


async def test_two_replicas_of_one_directory_are_one_base_under_load(
    vllm_replicas: list[VllmProcess],
    make_gateway: GatewayFactory,
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    urls = [replica.url for replica in vllm_replicas]
    floor = Settings().base_print_tolerance
    stopping: set[str] = set()
    async with base_load(http, urls, stopping) as answered:
        await eventually(lambda: answered[0] >= CLIENTS, "the load runs", 120)
        prints: list[base_print.BasePrint] = []
        for _ in range(PRINTS_EACH):
            for url in urls:
                taken = await probe(http, VllmDialect(), url, "base", floor)
                assert not isinstance(taken, str), taken
                prints.append(taken)
        pairs = list(itertools.combinations(prints, 2))
        worst = max(base_print.mean_difference(a.logprobs, b.logprobs) for a, b in pairs)
        print(f"{len(prints)} prints under load ({answered[0]} base answers meanwhile): largest mean "
              f"|dlogprob| between two {worst:.5f}, tolerance {floor}")  # fmt: skip
        for a, b in pairs:
            assert a.behaviour_difference(b) is None, "two prints of one directory under load differ"

        published = await kvgate_json(
            "publish", "tenant-42", str(fixture_dir / "adapters" / "v1"), "--replica", urls[0],
            "--replica", urls[1], "--base-model-dirs", UNREADABLE, redis_url=redis_server.url,
            store=tmp_path / "store",
        )  # fmt: skip
        assert published["base_print"].startswith("bp2-")

        for start in ("started", "restarted"):  # a kvgate started under load, then another in its place
            began = time.monotonic()
            async with make_gateway(replicas=urls, base_model_dirs=[UNREADABLE]) as gateway:
                for url in urls:
                    served = functools.partial(tenant_served_on, http, gateway.url, url)
                    await eventually(
                        served, f"the tenant served on {url} by a kvgate {start}", SERVES_WITHIN_S
                    )
                took = time.monotonic() - began
                async with http.get(
                    f"{gateway.url}/kvgate/status", headers={"x-kvgate-admin-token": ADMIN_TOKEN}
                ) as response:
                    status = await response.json()
                print(f"kvgate {start} under load: the tenant served on both replicas after {took:.1f} s; "
                      f"prints {[r['base_print'] for r in status['replicas']]}")  # fmt: skip
                assert status["base_disagreements"] == []
                assert all(r["base_mismatch"] == {} for r in status["replicas"])
                assert all(r["base_bytes_digest"] is None for r in status["replicas"]), "behaviour only"

        async with make_gateway(replicas=urls, base_model_dirs=[UNREADABLE]) as gateway:
            for url in urls:
                served = functools.partial(tenant_served_on, http, gateway.url, url)
                await eventually(served, f"the tenant served on {url}", SERVES_WITHIN_S)
            stopped = vllm_replicas[1]
            stopping.add(stopped.url)
            await stopped.stop()
            vllm_replicas[1] = VllmProcess(stopped.spec)  # the session fixture stops this one at its end
            await vllm_replicas[1].start()
            stopping.discard(stopped.url)
            began = time.monotonic()
            served = functools.partial(tenant_served_on, http, gateway.url, urls[1])
            await eventually(served, f"the tenant served on {urls[1]} again, restarted", SERVES_WITHIN_S)
            took = time.monotonic() - began
            print(f"replica restarted under load: the tenant served on it {took:.1f} s after it answered")
            async with http.get(
                f"{gateway.url}/kvgate/status", headers={"x-kvgate-admin-token": ADMIN_TOKEN}
            ) as response:
                status = await response.json()
            assert status["base_disagreements"] == []
            assert all(r["base_mismatch"] == {} for r in status["replicas"])
