"""``kvgate demo``: the fault and the cure side by side, on one machine, with no downloads.

It starts an embedded Redis, two real vLLM CPU replicas serving the tiny local model, and kvgate.
Direct path: ``tenant-42`` is loaded from a mutable path, warmed, its bytes replaced by v2 and
reloaded in place; the warm answer then disagrees with a cold one (the fault). Through kvgate: v1 is
published and warmed on both replicas, v2 is published under the same logical ID, and on each
replica the warm answer equals the cold one.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

from gateway.app import build_app
from gateway.config import Settings
from gateway.epoch_table import EpochTable
from gateway.experiment import Sample, complete, fresh_salt, long_prompt
from gateway.proxy import ADMIN_TOKEN_HEADER, PIN_HEADER
from gateway.publish import publish_adapter
from gateway.redis_server import EmbeddedRedis
from gateway.store import AdapterStore
from gateway.vllm_process import VllmProcess, VllmReplicaSpec, free_port, start_replicas

LOGICAL_ID = "tenant-42"
DEMO_TOKEN = "demo-admin-token"


@dataclass(frozen=True)
class Row:
    path: str
    replica: str
    served: str
    warm: Sample
    cold: Sample

    @property
    def coherent(self) -> bool:
        return self.warm.agrees_with(self.cold)


async def run_demo(settings: Settings, *, vllm_python: Path, fixture_dir: Path) -> bool:
    """Run the experiment and print the table; True when it showed the fault and the cure."""
    work = settings.data_dir.resolve() / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    specs = [
        VllmReplicaSpec(vllm_python, fixture_dir / "model", free_port(), work / f"vllm-{i}.log")
        for i in (0, 1)
    ]
    print(f"starting embedded Redis and two vLLM CPU replicas (logs in {work}) ...", flush=True)
    with EmbeddedRedis(work) as redis_server:
        replicas = await start_replicas(specs)
        try:
            async with aiohttp.ClientSession() as http:
                direct = await direct_inplace_reload(http, replicas[0].url, fixture_dir, work)
                cured = await through_kvgate(http, replicas, redis_server.url, fixture_dir, work)
        finally:
            await asyncio.gather(*(replica.stop() for replica in replicas))
    print_table([direct, *cured])
    showed = not direct.coherent and all(row.coherent for row in cured)
    print("\nresult:", "the fault on the direct path, coherent through kvgate" if showed else "UNEXPECTED")
    return showed


async def direct_inplace_reload(http: aiohttp.ClientSession, url: str, fixture_dir: Path, work: Path) -> Row:
    """vLLM alone: same name, same path, new bytes, reloaded in place."""
    mutable = work / "mutable" / LOGICAL_ID
    shutil.copytree(fixture_dir / "adapters" / "v1", mutable)
    await _post(http, f"{url}/v1/load_lora_adapter", {"lora_name": LOGICAL_ID, "lora_path": str(mutable)})
    prompt = long_prompt()
    for _ in range(2):
        await complete(http, url, LOGICAL_ID, prompt)  # v1 fills the prefix cache
    for item in (fixture_dir / "adapters" / "v2").iterdir():
        shutil.copyfile(item, mutable / item.name)  # publish v2 "in place"
    await _post(
        http,
        f"{url}/v1/load_lora_adapter",
        {"lora_name": LOGICAL_ID, "lora_path": str(mutable), "load_inplace": True},
    )
    warm = await complete(http, url, LOGICAL_ID, prompt)
    cold = await complete(http, url, LOGICAL_ID, prompt, cache_salt=fresh_salt())
    await _post(http, f"{url}/v1/unload_lora_adapter", {"lora_name": LOGICAL_ID})
    return Row("direct, in-place reload", url, f"{LOGICAL_ID} (same name and path)", warm, cold)


async def through_kvgate(
    http: aiohttp.ClientSession, replicas: list[VllmProcess], redis_url: str, fixture_dir: Path, work: Path
) -> list[Row]:
    """The same steps through kvgate: publish v1, warm every replica, publish v2, compare."""
    store = AdapterStore(work / "store")
    settings = Settings(
        replicas=[replica.url for replica in replicas],
        store=store.root,
        data_dir=work,
        reconcile_interval=0.2,
        poll_interval=0.5,
        drain_grace=5.0,
        admin_token=DEMO_TOKEN,
    )
    redis = Redis.from_url(redis_url)
    table = EpochTable(redis)
    runner = web.AppRunner(build_app(settings, redis), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    gateway = f"http://127.0.0.1:{port}"
    prompt = long_prompt()
    rows = []
    try:
        v1 = await publish_adapter(
            table, store, LOGICAL_ID, fixture_dir / "adapters" / "v1", settings.base_identity
        )
        print(f"published v1: {v1.name} (digest {v1.digest[:16]}..., epoch {v1.change.epoch})", flush=True)
        await asyncio.sleep(0.5)
        for replica in replicas:
            for _ in range(2):
                await complete(http, gateway, LOGICAL_ID, prompt, headers=_pin(replica.url))
        v2 = await publish_adapter(
            table, store, LOGICAL_ID, fixture_dir / "adapters" / "v2", settings.base_identity
        )
        print(f"published v2: {v2.name} (digest {v2.digest[:16]}..., epoch {v2.change.epoch})", flush=True)
        await asyncio.sleep(0.5)  # the hint reaches kvgate's snapshot
        for replica in replicas:
            await complete(http, gateway, LOGICAL_ID, prompt, headers=_pin(replica.url))  # loads v2 there
            warm = await complete(http, gateway, LOGICAL_ID, prompt, headers=_pin(replica.url))
            served = warm.evidence.get("x-kvgate-version", "?")
            cold = await complete(http, replica.url, served, prompt, cache_salt=fresh_salt())
            epoch = warm.evidence.get("x-kvgate-epoch")
            rows.append(Row("through kvgate", replica.url, f"{served} epoch {epoch}", warm, cold))
    finally:
        await runner.cleanup()
        await redis.aclose()
    return rows


def _pin(url: str) -> dict[str, str]:
    return {PIN_HEADER: url, ADMIN_TOKEN_HEADER: DEMO_TOKEN}


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with http.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'PATH':<24} {'REPLICA':<23} {'SERVED':<36} {'CACHED':>6}  {'WARM':<26} {'COLD':<26} WARM==COLD"
    )
    print()
    print(header)
    print("-" * len(header))
    for row in rows:
        verdict = "yes" if row.coherent else f"NO (max |dlogprob| {row.warm.max_logprob_diff(row.cold):.3f})"
        print(
            f"{row.path:<24} {row.replica.removeprefix('http://'):<16} {row.served:<35} "
            f"{row.warm.cached_tokens:>6}  {_short(row.warm.text):<22} {_short(row.cold.text):<22} {verdict}"
        )


def _short(text: str, width: int = 20) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 3] + "...'"
