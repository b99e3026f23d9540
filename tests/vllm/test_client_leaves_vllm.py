"""A client that leaves: the real vLLM stops the generation, and nothing else happens (no retry elsewhere).

Read from the replicas' ``/metrics``: ``vllm:prompt_tokens_total`` grows by one prompt per request that
reaches a replica (so a duplicate shows), ``vllm:generation_tokens_total`` by the tokens generated, and
``vllm:request_success_total`` counts finished requests by ``finished_reason``: those that ran to their end
(``stop``, ``length``) are ``completed``; an aborted one is counted there too, as ``abort``, when vLLM's
engine reports the abort before its front end has dropped the request (a race), so it is left out.
Requests ask the base model for 1,000 tokens, ignoring EOS, so a generation that is not stopped runs
to its end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import aiohttp
import pytest

from gateway.dev.vllm_process import VllmProcess
from tests.support.conditions import eventually
from tests.support.engine_pause import EngineThrottle
from tests.vllm.conftest import ADMIN_TOKEN, Gateway

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "Once upon a time"
LONG = {"model": "base", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}
METRICS = {
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generated",
    "vllm:request_success_total": "completed",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
}


RAN_TO_ITS_END = ('finished_reason="stop"', 'finished_reason="length"')


@contextmanager
def slowed(replicas: list[VllmProcess]) -> Iterator[Callable[[], None]]:
    """Every replica's engine slowed (``EngineThrottle``) while a client comes and goes; the block
    gets a function that holds every engine still: the test holds them as it sees the request on a replica,
    so the client leaves a generation that cannot end meanwhile. The abort reaches vLLM's engine as it runs
    again, when the block is left: the test leaves it once vLLM's front end has sent it (``aborted``), or
    the engine, at full speed again, could end the generation first (seen: ``completed`` 1, 1 run in 4)."""
    with ExitStack() as throttles:
        slowed = [throttles.enter_context(EngineThrottle(replica.pid)) for replica in replicas]

        def hold() -> None:
            for throttle in slowed:
                throttle.hold()

        yield hold


def aborts(replicas: list[VllmProcess]) -> int:
    """How many aborts vLLM's front ends have sent their engines (``Aborted request(s)`` log lines)."""
    return sum(replica.spec.log_path.read_bytes().count(b"Aborted request") for replica in replicas)


async def aborted(replicas: list[VllmProcess], before: int) -> None:
    """Until a replica's front end has sent its engine one more abort than ``before``."""

    async def sent() -> bool:
        return aborts(replicas) > before

    await eventually(sent, "vLLM's front end sent the abort to its engine", within=30.0)


async def vllm_counts(http: aiohttp.ClientSession, replicas: list[VllmProcess]) -> Counter[str]:
    """The metrics above, summed over every replica (``completed``: requests that ran to their end)."""
    counts: Counter[str] = Counter()
    for replica in replicas:
        async with http.get(f"{replica.url}/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name == "vllm:request_success_total" and not any(label in line for label in RAN_TO_ITS_END):
                continue
            if name in METRICS:
                counts[METRICS[name]] += int(float(line.rsplit(" ", 1)[1]))
    return counts


async def settled(
    http: aiohttp.ClientSession, gateway: Gateway, replicas: list[VllmProcess]
) -> tuple[int, Counter[str]]:
    """What one request with PROMPT costs in prompt tokens (a one-token completion through kvgate), and the
    replicas' counts once that request shows in them.

    vLLM counts a request in ``/metrics`` a moment after it answered it: counts read at once can miss it,
    and it would then show as a request of the test that reads them next. Nothing may wait either: a
    request an earlier test left queued on a replica (``waiting``, not ``running``) would end later, counted
    as this test's (a fresh-clone run saw ``completed`` 1 and a request that never ran within 30 s).
    """
    start = await vllm_counts(http, replicas)
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 1}
    async with http.post(f"{gateway.url}/v1/completions", json=body) as response:
        tokens: int = (await response.json())["usage"]["prompt_tokens"]
    now: Counter[str] = Counter()

    async def counted() -> bool:
        nonlocal now
        now = await vllm_counts(http, replicas)
        return now["completed"] > start["completed"] and now["running"] == now["waiting"] == 0

    await eventually(counted, "the one-token request counted, nothing running or waiting", within=60.0)
    return tokens, now


async def after_it_stopped(
    http: aiohttp.ClientSession, replicas: list[VllmProcess], before: Counter[str], prompt: int
) -> Counter[str]:
    """Once a prompt reached a replica and nothing runs any more: what changed since ``before``."""
    now: Counter[str] = Counter()

    async def stopped() -> bool:
        nonlocal now
        now = await vllm_counts(http, replicas)
        idle = now["running"] == now["waiting"] == 0
        return now["prompt_tokens"] - before["prompt_tokens"] >= prompt and idle

    await eventually(stopped, "the request reached vLLM and nothing runs", within=60.0)
    return Counter({key: now[key] - before[key] for key in ("prompt_tokens", "generated", "completed")})


async def retries(http: aiohttp.ClientSession, gateway: Gateway) -> float:
    headers = {"x-kvgate-admin-token": ADMIN_TOKEN}
    async with http.get(f"{gateway.url}/metrics", headers=headers) as response:
        text = await response.text()
    prefix = 'kvgate_routing_decisions_total{decision="retry"}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def replicas_healthy(http: aiohttp.ClientSession, gateway: Gateway) -> list[bool]:
    headers = {"x-kvgate-admin-token": ADMIN_TOKEN}
    async with http.get(f"{gateway.url}/kvgate/status", headers=headers) as response:
        return [replica["healthy"] for replica in (await response.json())["replicas"]]


async def test_a_client_that_closes_a_stream_stops_one_generation_and_nothing_else(
    gateway: Gateway, vllm_replicas: list[VllmProcess], http: aiohttp.ClientSession
) -> None:
    prompt, before = await settled(http, gateway, vllm_replicas)
    retries_before = await retries(http, gateway)
    async with aiohttp.ClientSession() as client:
        with slowed(vllm_replicas) as hold:
            response = await client.post(f"{gateway.url}/v1/completions", json=LONG | {"stream": True})
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            hold()
            sent = aborts(vllm_replicas)
            response.close()  # the client leaves mid-stream
            await aborted(vllm_replicas, sent)
    since = await after_it_stopped(http, vllm_replicas, before, prompt)
    assert since["prompt_tokens"] == prompt  # one request reached a replica: none was sent again
    assert since["completed"] == 0  # it did not run to its end...
    assert since["generated"] < 1000  # ...it was stopped
    assert await retries(http, gateway) == retries_before
    assert await replicas_healthy(http, gateway) == [True] * len(vllm_replicas)  # all([]) would pass


async def test_a_client_that_leaves_a_pending_request_stops_its_generation(
    gateway: Gateway, vllm_replicas: list[VllmProcess], http: aiohttp.ClientSession
) -> None:
    prompt, before = await settled(http, gateway, vllm_replicas)
    async with aiohttp.ClientSession() as client:
        with slowed(vllm_replicas) as hold:
            pending = asyncio.ensure_future(client.post(f"{gateway.url}/v1/completions", json=LONG))

            async def generating() -> bool:
                seen = await vllm_counts(http, vllm_replicas)
                if pending.done():  # the premise missed: say how, rather than wait out the bound
                    answer = pending.result()
                    pytest.fail(
                        f"the request ended before it was seen on a replica: {answer.status} "
                        f"{(await answer.text())[:300]!r}, {seen}"
                    )
                return seen["running"] + seen["waiting"] > 0

            await eventually(generating, "the request is on a replica (running or waiting)", within=30.0)
            hold()
            sent = aborts(vllm_replicas)
            pending.cancel()  # the client gives up and closes its connection, the answer still pending
            with pytest.raises(asyncio.CancelledError):
                await pending
            await aborted(vllm_replicas, sent)
    since = await after_it_stopped(http, vllm_replicas, before, prompt)
    assert since["prompt_tokens"] == prompt
    assert since["generated"] < 1000, since  # it was stopped...
    assert since["completed"] == 0, since  # ...before its end
