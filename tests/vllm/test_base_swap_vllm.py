"""A base swapped under a replica's name and path, on real vLLM: kvgate fingerprints it as another base.

Replica A is this module's own (started from a symlink it can point at other weights: the fixture's
model, or ``KVGATE_OTHER_BASE_DIR``'s, built like the fixture with another seed); replica B is a session
replica. A tenant's version is published for the fixture's base (``kvgate publish`` fingerprints it)
and served by both. A restarts with the other weights under the same served name and the same path:
kvgate routes nothing of the tenant there once it is back, says why (``/kvgate/status``, a metric), the
audit calls it ``replica-mismatch`` with both fingerprints, and B keeps serving coherently. A restarted
with the original weights is eligible again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.core.wire import REPLICA_HEADER, replica_id
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec
from gateway.process.http_edge import free_port
from gateway.proof.audit import COHERENT, MISMATCH, GatewayTarget, audit_round
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually
from tests.vllm.conftest import ADMIN_TOKEN, GatewayFactory, kvgate_json

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(900)]  # three vLLM starts

PROMPT = "The harbor master counted the boats. " * 40  # over two KV blocks: warm hits show


def other_base() -> Path:
    value = os.environ.get("KVGATE_OTHER_BASE_DIR")
    if not value or not (Path(value) / "model" / "config.json").exists():
        pytest.fail("KVGATE_OTHER_BASE_DIR is not set to the other base (make .cache-base/.done; make test)")
    return Path(value) / "model"


class SwappableReplica:
    """A vLLM replica started from ``link``, a symlink this test re-points between restarts."""

    def __init__(self, spec: VllmReplicaSpec, link: Path) -> None:
        self.spec, self.link = spec, link
        self.process: VllmProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    async def start(self, weights: Path) -> None:
        self.link.unlink(missing_ok=True)
        self.link.symlink_to(weights)
        self.process = VllmProcess(self.spec)
        await self.process.start()

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


@contextlib.asynccontextmanager
async def swappable(fixture_dir: Path, tmp_path: Path) -> AsyncIterator[SwappableReplica]:
    python = Path(os.environ["KVGATE_VLLM_PYTHON"])
    link = tmp_path / "model"
    replica = SwappableReplica(VllmReplicaSpec(python, link, free_port(), tmp_path / "swap.log"), link)
    try:
        await replica.start(fixture_dir / "model")
        yield replica
    finally:
        await replica.stop()


async def status_of(http: aiohttp.ClientSession, gateway: str, url: str) -> dict[str, Any]:
    async with http.get(f"{gateway}/kvgate/status", headers={"x-kvgate-admin-token": ADMIN_TOKEN}) as r:
        replicas = {entry["url"]: entry for entry in (await r.json())["replicas"]}
    found: dict[str, Any] = replicas[url]
    return found


async def complete(http: aiohttp.ClientSession, gateway: str, pin: str | None = None) -> tuple[int, str]:
    """One greedy completion of the tenant: (status, the replica that answered)."""
    body = {"model": "tenant-42", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    headers = {"x-kvgate-pin": pin, "x-kvgate-admin-token": ADMIN_TOKEN} if pin else {}
    async with http.post(f"{gateway}/v1/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status, response.headers.get(REPLICA_HEADER, "")


async def test_a_base_swapped_under_the_same_name_and_path_is_another_base(
    vllm_replicas: list[VllmProcess],
    make_gateway: GatewayFactory,
    session_redis: Redis,
    redis_server: EmbeddedRedis,
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    other = other_base()
    b = vllm_replicas[0]
    async with swappable(fixture_dir, tmp_path) as a:
        replicas = [a.url, b.url]
        published = await kvgate_json(
            "publish", "tenant-42", str(fixture_dir / "adapters" / "v1"),
            "--replica", a.url, "--replica", b.url, redis_url=redis_server.url, store=tmp_path / "store",
        )  # fmt: skip
        assert published["base"] == "base"
        assert published["base_print"].startswith("bp2-")
        print(f"published for base {published['base']} with fingerprint {published['base_print']}")
        async with make_gateway(replicas=replicas, poll_interval=0.5) as gateway:
            for url in replicas:  # pinned: the version is loaded on both
                assert (await complete(http, gateway.url, pin=url))[0] == 200
            before = await status_of(http, gateway.url, a.url)
            assert before["base_print"] == published["base_print"]
            assert before["base_bytes_digest"], "the fixture's files are readable here: their digest is taken"

            answered: list[str] = []  # the replica of every tenant answer from the swap on

            async def traffic() -> None:
                while True:
                    code, replica = await complete(http, gateway.url)
                    assert code == 200
                    answered.append(replica)
                    await asyncio.sleep(0.05)

            # The traffic starts once A is down: a request in flight to A when it is stopped may be aborted
            # (vLLM logs its shutdown as mode=abort), and that 500 is not what this test is about.
            await a.stop()
            sender = asyncio.create_task(traffic())
            try:
                await a.start(other)  # the same served name and path, other weights

                async def reported() -> bool:
                    seen = await status_of(http, gateway.url, a.url)
                    return bool(seen["healthy"]) and "tenant-42" in seen["base_mismatch"]

                await eventually(reported, "the swapped base reported", 60)
                known = len(answered)  # a few more answers with A up and known to be another base
                await eventually(lambda: len(answered) >= known + 10, "ten more answers", 60)
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            assert answered, "the tenant kept being served"
            assert set(answered) == {replica_id(b.url)}, (
                "nothing of the tenant was served by the swapped replica"
            )

            swapped = await status_of(http, gateway.url, a.url)
            shown = (
                "base_print",
                "base_print_previous",
                "base_print_changed",
                "base_bytes_digest",
                "last_restart",
            )
            print("swapped:", {key: swapped[key] for key in shown}, "mismatch:", swapped["base_mismatch"])
            assert swapped["base_print"] != published["base_print"]
            assert swapped["base_print_previous"] == published["base_print"]
            assert "base fingerprint changed" in swapped["base_print_changed"]
            assert swapped["base_bytes_digest"] != before["base_bytes_digest"]
            assert f'kvgate_base_mismatched_versions{{replica="{a.url}"}} 1.0' in exposition(gateway.metrics)
            code, _ = await complete(http, gateway.url, pin=a.url)
            assert code == 503, "pinned there, it is refused: no replica of that fingerprint"

            verdicts = {
                v.replica: v
                for v in await audit_round(http, GatewayTarget(gateway.url, "tenant-42", ADMIN_TOKEN))
            }
            for v in verdicts.values():
                print(f"audit {v.replica}: {v.verdict}: {v.detail}")
            assert verdicts[a.url].verdict == MISMATCH
            assert published["base_print"] in verdicts[a.url].detail
            assert swapped["base_print"] in verdicts[a.url].detail
            assert verdicts[b.url].verdict == COHERENT
            assert verdicts[b.url].cached_tokens > 0

            await a.stop()
            await a.start(fixture_dir / "model")  # back to the original weights

            async def served_there_again() -> bool:
                return (await complete(http, gateway.url, pin=a.url))[0] == 200

            await eventually(served_there_again, "eligible again", 60)
            back = await status_of(http, gateway.url, a.url)
            assert back["base_mismatch"] == {}
            assert back["base_print"] == published["base_print"]
            assert back["base_bytes_digest"] == before["base_bytes_digest"]
            verdicts = {
                v.replica: v
                for v in await audit_round(http, GatewayTarget(gateway.url, "tenant-42", ADMIN_TOKEN))
            }
            assert {v.verdict for v in verdicts.values()} == {COHERENT}


def exposition(metrics: Any) -> str:
    text: str = metrics.exposition().decode()
    return text
