"""``kvgate audit`` on real vLLM: it finds the fault, clears kvgate, and tells mixed versions apart."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.core.identity import scan_adapter, tree_digest
from gateway.dev.vllm_process import VllmProcess
from gateway.table.redis_server import EmbeddedRedis
from tests.vllm.conftest import ADMIN_TOKEN, Gateway, GatewayFactory, kvgate_json, post_json, run_kvgate

pytestmark = pytest.mark.asyncio(loop_scope="session")

RELOAD_SCRIPT = """
import json, shutil, sys, urllib.request
url, name, src, dst = sys.argv[1:5]
for item in __import__("pathlib").Path(src).iterdir():
    shutil.copyfile(item, f"{dst}/{item.name}")
body = json.dumps({"lora_name": name, "lora_path": dst, "load_inplace": True}).encode()
request = urllib.request.Request(url + "/v1/load_lora_adapter", body, {"Content-Type": "application/json"})
urllib.request.urlopen(request).read()
"""


def verdicts(doc: dict[str, list[dict[str, object]]], round_name: str) -> dict[object, object]:
    return {v["replica"]: v["verdict"] for v in doc[round_name]}


async def test_direct_audit_finds_the_inplace_reload_fault(
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    tmp_path: Path,
    redis_server: EmbeddedRedis,
) -> None:
    url = vllm_replicas[0].url
    mutable = tmp_path / "audited"
    shutil.copytree(fixture_dir / "adapters" / "v1", mutable)
    script = tmp_path / "reload.py"
    script.write_text(RELOAD_SCRIPT)
    await post_json(http, f"{url}/v1/load_lora_adapter", {"lora_name": "audited", "lora_path": str(mutable)})
    reload = shlex.join(
        [sys.executable, str(script), url, "audited", str(fixture_dir / "adapters" / "v2"), str(mutable)]
    )
    try:
        code, out, err = await run_kvgate(
            "audit", "--direct", url, "--model", "audited", "--before-after", "--reload-cmd", reload,
            "--json",
            redis_url=redis_server.url, store=tmp_path / "unused-store",
        )  # fmt: skip
    finally:
        await post_json(http, f"{url}/v1/unload_lora_adapter", {"lora_name": "audited"})
    assert code == 3, err
    doc = json.loads(out)
    assert verdicts(doc, "before") == {url: "coherent"}
    assert verdicts(doc, "after") == {url: "incoherent-on-warm-hit"}
    (after,) = doc["after"]
    assert after["cached_tokens"] >= 384
    assert after["observation"]["loaded_root"] == str(mutable)


async def test_audit_through_kvgate_after_a_publish_is_coherent_everywhere(
    gateway: Gateway,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
) -> None:
    redis_url = redis_server.url
    await kvgate_json(
        "publish", "tenant-7", str(fixture_dir / "adapters" / "v1"), redis_url=redis_url, store=gateway.store
    )
    code, out, err = await run_kvgate(
        "audit", "tenant-7", "--gateway", gateway.url, "--admin-token", ADMIN_TOKEN, "--before-after",
        "--publish", str(fixture_dir / "adapters" / "v3"), "--json",
        redis_url=redis_url, store=gateway.store,
    )  # fmt: skip
    assert code == 0, err + out
    doc = json.loads(out)
    everywhere = {replica.url: "coherent" for replica in vllm_replicas}
    assert verdicts(doc, "before") == everywhere
    assert verdicts(doc, "after") == everywhere
    v3 = tree_digest(fixture_dir / "adapters" / "v3", scan_adapter(fixture_dir / "adapters" / "v3"))
    for verdict in doc["after"]:
        observation = verdict["observation"]
        assert observation["digest"] == v3
        assert observation["served"] == f"tenant-7@{v3[:16]}"
        assert observation["loaded_root"] == str(gateway.store.resolve() / v3)
        assert verdict["cached_tokens"] >= 384
        assert observation["block_key"]

    human = await run_kvgate(
        "audit", "tenant-7", "--gateway", gateway.url, "--admin-token", ADMIN_TOKEN,
        redis_url=redis_url, store=gateway.store,
    )  # fmt: skip
    assert human[0] == 0
    assert "coherent" in human[1]


async def test_audit_through_the_admin_listener_with_api_keys_on(
    make_gateway: GatewayFactory,
    vllm_replicas: list[VllmProcess],
    redis_server: EmbeddedRedis,
    fixture_dir: Path,
    tmp_path: Path,
) -> None:
    """With keys on and the admin surface on its own listener, the audit runs there (the admin token
    stands for the operator; pins may name replicas by URL), and the public listener refuses it."""
    redis_url, store = redis_server.url, tmp_path / "store"
    await kvgate_json(
        "publish", "tenant-8", str(fixture_dir / "adapters" / "v2"), redis_url=redis_url, store=store
    )
    async with make_gateway(auth="api-keys", admin_port=0) as started:
        assert started.admin_url is not None
        code, out, err = await run_kvgate(
            "audit", "tenant-8", "--gateway", started.admin_url, "--admin-token", ADMIN_TOKEN, "--json",
            redis_url=redis_url, store=store,
        )  # fmt: skip
        public = await run_kvgate(
            "audit", "tenant-8", "--gateway", started.url, "--admin-token", ADMIN_TOKEN,
            redis_url=redis_url, store=store,
        )  # fmt: skip
    assert code == 0, err + out
    assert verdicts(json.loads(out), "audit") == {replica.url: "coherent" for replica in vllm_replicas}
    assert public[0] == 1, public[2]
    assert "audit through it" in public[2]
    assert len(public[2].strip().splitlines()) == 1


async def test_a_replica_left_on_the_old_version_is_a_mismatch(
    vllm_replicas: list[VllmProcess],
    http: aiohttp.ClientSession,
    fixture_dir: Path,
    redis_server: EmbeddedRedis,
    tmp_path: Path,
) -> None:
    new, old = fixture_dir / "adapters" / "v2", fixture_dir / "adapters" / "v1"
    current, stale = vllm_replicas
    await post_json(
        http, f"{current.url}/v1/load_lora_adapter", {"lora_name": "mixed", "lora_path": str(new)}
    )
    await post_json(http, f"{stale.url}/v1/load_lora_adapter", {"lora_name": "mixed", "lora_path": str(old)})
    try:
        code, out, err = await run_kvgate(
            "audit", "--direct", current.url, "--direct", stale.url, "--model", "mixed",
            "--expect-digest", tree_digest(new, scan_adapter(new)), "--json",
            redis_url=redis_server.url, store=tmp_path / "unused-store",
        )  # fmt: skip
    finally:
        for replica in vllm_replicas:
            await post_json(http, f"{replica.url}/v1/unload_lora_adapter", {"lora_name": "mixed"})
    assert code == 3, err
    assert verdicts(json.loads(out), "audit") == {current.url: "coherent", stale.url: "replica-mismatch"}
