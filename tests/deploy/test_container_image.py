"""kvgate's image, built from this tree with podman (scripts/images.py, layer cache on) and run as the
manifests run it: its own non-root user, a read-only root filesystem, every capability dropped, no
privilege escalation, an empty volume on /tmp for its data dir, the store volume on /adapters. ``kvgate
serve`` in it fronts the stub replica image in the same pod, with the embedded Redis inside the image and
with Redis from the Redis image; the image's HEALTHCHECK and the manifests' liveness command follow the
real states (ready, draining, not alive); a publish in the container writes the store volume, and the
replica (which refuses a path without an adapter, as vLLM does) loads the version from it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from scripts import images
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import eventually, until_healthy
from tests.support.containers import KVGATE_UID, RESTRICTED, Pod, health, owned_dir, pod, podman

pytestmark = pytest.mark.timeout(900)
TOKEN = "image-test-admin-token"


@pytest.fixture(scope="module")
def built() -> dict[str, str]:
    """The images, from this tree: podman's layer cache makes an unchanged tree's build a few seconds."""
    return {name: images.build(name, quiet=True) for name in ("kvgate", "stub", "redis")}


@pytest.fixture
def volumes(tmp_path: Path) -> dict[str, Path]:
    """The store (kvgate's, like claim kvgate-adapters with fsGroup 10001) and an empty /tmp."""
    return {"store": owned_dir(tmp_path / "store"), "tmp": owned_dir(tmp_path / "tmp")}


def kvgate_options(volumes: dict[str, Path], adapter: Path, *env: str) -> tuple[str, ...]:
    settings = ["KVGATE_REPLICAS=http://127.0.0.1:8000", "KVGATE_DATA_DIR=/tmp/kvgate",
                "KVGATE_STORE=/adapters", "KVGATE_ADMIN_PORT=9090", "KVGATE_ADMIN_HOST=0.0.0.0",
                f"KVGATE_ADMIN_TOKEN={TOKEN}", "KVGATE_POLL_INTERVAL=0.5", "KVGATE_SHUTDOWN_TIMEOUT=30",
                *env]  # fmt: skip
    return (
        *RESTRICTED,
        *[f"--env={setting}" for setting in settings],
        f"--volume={volumes['store']}:/adapters",
        f"--volume={volumes['tmp']}:/tmp",
        f"--volume={adapter}:/incoming/tenant-1:ro",
    )


def start_stub(p: Pod, image: str, volumes: dict[str, Path], delay: float = 0.0) -> str:
    options = (*RESTRICTED, f"--user={KVGATE_UID}", f"--volume={volumes['store']}:/adapters:ro")
    args = ("serve", "/models/base", "--served-model-name=base", "--port=8000", f"--stub-chunk-delay={delay}")
    return p.run("replica", image, *args, options=options)


async def published_and_served(p: Pod, kvgate: str, volumes: dict[str, Path]) -> str:
    """Publish tenant-1 in the container; a completion for it loads the version from the store volume."""
    done = podman("exec", kvgate, "kvgate", "publish", "--json", "tenant-1", "/incoming/tenant-1")
    digest = str(json.loads(done.stdout)["digest"])
    stored = volumes["store"] / digest
    assert (stored / "adapter_config.json").is_file(), f"the publish wrote the store volume: {done.stdout}"
    assert stored.stat().st_uid == KVGATE_UID
    client = openai.AsyncOpenAI(base_url=f"http://{p.ip}:8080/v1", api_key="unused", max_retries=0)
    answer = await client.completions.create(model="tenant-1", prompt="hello", max_tokens=4)
    await client.close()
    assert answer.model == "tenant-1"
    async with aiohttp.ClientSession() as http, http.get(f"http://{p.ip}:8000/v1/models") as listing:
        loaded = {model["id"]: model["root"] for model in (await listing.json())["data"]}
    assert loaded == {"base": "/models/base", f"tenant-1@{digest[:16]}": f"/adapters/{digest}"}, loaded
    return digest


def test_the_image_runs_as_its_user_read_only_without_capabilities(built: dict[str, str]) -> None:
    config = podman("image", "inspect", "--format", "{{json .Config}}", built["kvgate"]).stdout
    assert json.loads(config)["User"] == f"{KVGATE_UID}:{KVGATE_UID}"
    probe = "grep -E '^(Uid|Gid|CapEff|CapPrm|NoNewPrivs):' /proc/self/status; touch /opt/x 2>&1 || true"
    done = podman("run", "--rm", *RESTRICTED, "--entrypoint=sh", built["kvgate"], "-c", probe)
    status = dict(line.split(":\t", 1) for line in done.stdout.splitlines() if ":\t" in line)
    assert status["Uid"].split()[0] == str(KVGATE_UID), done.stdout
    assert status["Gid"].split()[0] == str(KVGATE_UID), done.stdout
    assert int(status["CapEff"], 16) == 0, done.stdout
    assert int(status["CapPrm"], 16) == 0, done.stdout
    assert status["NoNewPrivs"].strip() == "1", done.stdout
    assert "Read-only file system" in done.stdout, done.stdout
    healthcheck = podman("image", "inspect", "--format", "{{json .HealthCheck}}", built["kvgate"]).stdout
    assert json.loads(healthcheck)["Test"] == ["CMD", "python", "-m", "gateway.healthcheck"], healthcheck


async def test_serve_with_the_embedded_redis_ready_draining_not_alive(
    built: dict[str, str], volumes: dict[str, Path], make_adapter: MakeAdapter
) -> None:
    with pod("kvgate-image") as p:
        start_stub(p, built["stub"], volumes, delay=3.0)
        kvgate = p.run("kvgate", built["kvgate"], "serve", options=kvgate_options(volumes, make_adapter()))
        try:
            await until_healthy(f"http://{p.ip}:8080")
        except BaseException:
            print(p.logs())
            raise
        assert (volumes["tmp"] / "kvgate" / "redis").is_dir(), "the embedded Redis lives in the data dir"
        assert health(kvgate) == 0, "HEALTHCHECK: ready"
        await published_and_served(p, kvgate, volumes)
        alive = ("exec", kvgate, "python", "-m", "gateway.healthcheck", "--alive")
        assert podman(*alive, check=False).returncode == 0

        podman("kill", "--signal=STOP", kvgate)  # a process that no longer answers
        assert health(kvgate) == 1, "HEALTHCHECK: not ready while it does not answer"
        assert podman(*alive, check=False).returncode == 1, "liveness: not alive while it does not answer"
        podman("kill", "--signal=CONT", kvgate)
        await until_healthy(f"http://{p.ip}:8080")
        assert health(kvgate) == 0

        client = openai.AsyncOpenAI(base_url=f"http://{p.ip}:8080/v1", api_key="unused", max_retries=0)
        # a request in flight: the stub waits 3 s before each of its 4 chunks, so the stream outlasts the
        # checks below (podman execs, seconds each on a loaded machine: at 1.5 s a fresh-clone run saw the
        # drain end, and kvgate exit, before its liveness check)
        stream = await client.completions.create(model="tenant-1", prompt="slow", max_tokens=4, stream=True)
        chunks = stream.__aiter__()
        first = await chunks.__anext__()
        podman("kill", "--signal=TERM", kvgate)

        async def draining() -> bool:
            return health(kvgate) == 1

        await eventually(draining, "HEALTHCHECK: not ready once draining", within=5)
        assert podman(*alive, check=False).returncode == 0, "liveness: a draining kvgate is alive"
        rest = [chunk async for chunk in chunks]
        await client.close()
        assert first.choices, "the request in flight started before the drain"
        assert rest, "the request in flight finished during the drain"
        done = podman("wait", kvgate, timeout=60)
        assert done.stdout.strip() == "0", p.logs()
        assert health(kvgate) != 0, "no process: not healthy"


async def test_serve_with_redis_from_the_redis_image(
    built: dict[str, str], volumes: dict[str, Path], make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = owned_dir(tmp_path / "redis-data", uid=999)
    with pod("kvgate-image-redis") as p:
        redis_options = (*RESTRICTED, "--user=999:999", f"--volume={data}:/data")
        p.run(
            "redis",
            built["redis"],
            "redis-server",
            "--port",
            "6379",
            "--appendonly",
            "yes",
            options=redis_options,
        )
        start_stub(p, built["stub"], volumes)
        options = kvgate_options(volumes, make_adapter(), "KVGATE_REDIS_URL=redis://127.0.0.1:6379/0")
        kvgate = p.run("kvgate", built["kvgate"], "serve", options=options)
        try:
            await until_healthy(f"http://{p.ip}:8080")
        except BaseException:
            print(p.logs())
            raise
        assert not (volumes["tmp"] / "kvgate" / "redis").exists(), "no embedded Redis with KVGATE_REDIS_URL"
        digest = await published_and_served(p, kvgate, volumes)
        redis = f"{p.name}-redis"
        state = podman("exec", redis, "redis-cli", "hgetall", "kvg:{epochs}:state:tenant-1").stdout
        assert digest in state, state
        assert health(kvgate) == 0
        await asyncio.to_thread(podman, "stop", "-t", "40", kvgate)
