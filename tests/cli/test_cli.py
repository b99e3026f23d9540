"""The ``kvgate`` CLI as an operator runs it: embedded Redis by default, exit codes, nothing half-done."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.process.http_edge import free_port, running
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import until_healthy
from tests.support.stub_backend import StubState, build_stub


def kvgate(*args: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "gateway.cli",
        *args,
        "--data-dir",
        str(data_dir),
        "--store",
        str(data_dir / "store"),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def ok(*args: str, data_dir: Path) -> dict[str, Any]:
    done = kvgate(*args, "--json", data_dir=data_dir)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_publish_rollback_bump_status_on_the_embedded_redis(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    v1 = ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
    again = ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
    v2 = ok("publish", "tenant-42", str(make_adapter(b"v2")), data_dir=data)
    assert (v1["epoch"], again["changed"], again["epoch"], v2["epoch"]) == (1, False, 1, 2)
    assert v1["name"] == f"tenant-42@{v1['digest'][:16]}"
    assert Path(v1["path"]) == (data / "store" / v1["digest"]).resolve()

    back = ok("rollback", "tenant-42", data_dir=data)
    assert (back["digest"], back["epoch"]) == (v1["digest"], 3)
    assert ok("bump", "tenant-42", data_dir=data)["epoch"] == 4

    # Each command started and stopped its own redis-server; the table persisted on disk.
    status = ok("status", data_dir=data)
    (row,) = status["logical_ids"]
    assert (row["digest"], row["epoch"], row["loaded_on"]) == (v1["digest"], 4, [])
    table = kvgate("status", data_dir=data)
    assert table.returncode == 0
    assert "tenant-42" in table.stdout
    assert v1["digest"][:16] in table.stdout


def test_cli_adopts_a_running_embedded_redis(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    with EmbeddedRedis(data) as running:
        ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
        assert running.owned  # the CLI used the server we started, and left it running
        assert kvgate("status", data_dir=data).returncode == 0


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        ("no-config", "no adapter_config.json"),
        ("symlink", "refusing symlink"),
        ("missing", "is missing"),
        ("empty-config", "adapter_config.json lacks r, lora_alpha, target_modules"),
        ("r-a-word", 'adapter_config.json r must be a positive integer, not "eight"'),
        ("utf16-config", "adapter_config.json is not UTF-8 text"),
    ],
)
def test_invalid_publish_exits_nonzero_and_writes_nothing(
    make_adapter: MakeAdapter, tmp_path: Path, breakage: str, reason: str
) -> None:
    data = tmp_path / "kvgate"
    source = make_adapter(b"v1")
    if breakage == "no-config":
        (source / "adapter_config.json").unlink()
    elif breakage == "empty-config":
        (source / "adapter_config.json").write_text("{}")
    elif breakage == "r-a-word":
        config = source / "adapter_config.json"
        config.write_text(config.read_text().replace('"r": 8', '"r": "eight"'))
    elif breakage == "utf16-config":
        config = source / "adapter_config.json"
        config.write_text(config.read_text(), encoding="utf-16")
    elif breakage == "symlink":
        (source / "evil").symlink_to("/etc/passwd")
    else:
        source = tmp_path / "does-not-exist"
    done = kvgate("publish", "tenant-42", str(source), data_dir=data)
    assert done.returncode == 2
    assert reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (data / "store").exists()
    assert not data.exists(), "not even the embedded Redis was started"


def test_bad_logical_id_and_unknown_rollback(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    bad = kvgate("publish", "tenant@42", str(make_adapter()), data_dir=data)
    assert bad.returncode == 2
    assert "invalid logical ID" in bad.stderr
    missing = kvgate("rollback", "nobody", data_dir=data)
    assert missing.returncode == 2
    assert "no published version" in missing.stderr


@pytest.mark.parametrize(
    ("source", "split", "reason"),
    [
        (True, "prefix", "--split-key 'prefix' is not one of user, api-key, conversation"),
        (True, "", "--split-key '' is not one of user, api-key, conversation"),
        (False, "user", "--split-key goes with a SOURCE directory (a new rollout)"),
    ],
)
def test_a_rollouts_split_key_is_refused_with_one_line_and_nothing_started(
    make_adapter: MakeAdapter, tmp_path: Path, source: bool, split: str, reason: str
) -> None:
    data = tmp_path / "kvgate"
    adapter = [str(make_adapter(b"v2"))] if source else []
    done = kvgate("rollout", "tenant-42", *adapter, "--percent", "25", "--split-key", split, data_dir=data)
    assert done.returncode == 2
    assert reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not data.exists(), "nothing stored, not even the embedded Redis started"


async def test_serve_runs_with_its_own_redis_and_stops_cleanly(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    published = ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
    stub = StubState()
    async with running(build_stub(stub)) as stub_url:
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
                   "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
        server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            await until_healthy(url)
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
                completion = await client.completions.create(model="tenant-42", prompt="p", max_tokens=1)
            assert completion.model == "tenant-42"
            assert stub.received[-1]["model"] == published["name"]
        finally:
            server.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(server.communicate(), timeout=30)
    assert server.returncode == 0, err.decode()
    assert not EmbeddedRedis(data).answers(), "the embedded Redis stops with serve"


def test_otel_console_exporter_traces_cli_mutations(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    command = [sys.executable, "-m", "gateway.cli", "publish", "tenant-42", str(make_adapter(b"v1")),
               "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "kvgate-test"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 0, done.stderr
    assert '"name": "kvgate.publish"' in done.stdout
    assert '"kvgate.logical_id": "tenant-42"' in done.stdout
    assert '"service.name": "kvgate-test"' in done.stdout


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("audit", "--direct", "http://127.0.0.1:9"), "--direct needs --model"),
        (("audit", "tenant-42"), "--gateway URL and an admin token"),
        (("audit", "--direct", "http://127.0.0.1:9", "--model", "m", "--before-after"), "needs --reload-cmd"),
        (("audit", "tenant-42", "--gateway", "http://127.0.0.1:9", "--admin-token", "t", "--before-after"),
         "needs --publish"),
    ],
)  # fmt: skip
def test_audit_refuses_incoherent_arguments(args: tuple[str, ...], reason: str, tmp_path: Path) -> None:
    done = kvgate(*args, data_dir=tmp_path / "kvgate")
    assert done.returncode == 2
    assert reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_audit_of_an_unreachable_server_fails_with_one_line(tmp_path: Path) -> None:
    done = kvgate(
        "audit", "--direct", f"http://127.0.0.1:{free_port()}", "--model", "m", data_dir=tmp_path / "k"
    )
    assert done.returncode == 1
    assert "kvgate audit:" in done.stderr
    assert "Traceback" not in done.stderr


def test_publish_with_redis_unreachable_fails_with_one_line_and_stores_nothing(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    done = kvgate("publish", "tenant-42", str(make_adapter(b"v1")), "--redis-url", unreachable, data_dir=data)
    assert done.returncode == 1
    assert done.stderr.startswith("kvgate publish: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (data / "store").exists(), "Redis is checked before the store is written"


def test_publish_over_max_adapter_bytes_exits_2_and_writes_nothing(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    data = tmp_path / "kvgate"
    source = make_adapter(b"")
    with open(source / "adapter_model.safetensors", "r+b") as weights:
        weights.truncate(64 << 20)  # sparse: 64 MiB long, no data
    command = [sys.executable, "-m", "gateway.cli", "publish", "tenant-42", str(source),
               "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
    env = {**os.environ, "KVGATE_MAX_ADAPTER_BYTES": str(1 << 20)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2, done.stdout
    assert "max_adapter_bytes" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not data.exists(), "neither the store nor the embedded Redis was touched"


@pytest.mark.parametrize(
    ("command", "variable", "nearest"),
    [(["serve", "--replica", "http://127.0.0.1:9", "--port", "0"], "KVGATE_AUHT=api-keys", "KVGATE_AUTH"),
     (["status"], "KVGATE_CONFG=kvgate.toml", "KVGATE_CONFIG")],
)  # fmt: skip
def test_a_kvgate_variable_that_names_no_setting_stops_every_command_with_exit_2(
    tmp_path: Path, command: list[str], variable: str, nearest: str
) -> None:
    """A typo must not start kvgate with the default (``auth = "off"``): exit 2 before anything starts,
    one line naming the variable and the nearest setting."""
    data = tmp_path / "kvgate"
    name, _, value = variable.partition("=")
    full = [sys.executable, "-m", "gateway.cli", *command, "--data-dir", str(data)]
    env = {**os.environ, name: value}
    done = subprocess.run(full, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"kvgate {command[0]}: environment variable {name} is not a kvgate setting "
        f"(did you mean {nearest}?): unset it or fix its name (see docs/configuration.md)"
    ]
    assert not data.exists(), "nothing started: no embedded Redis, no store"
