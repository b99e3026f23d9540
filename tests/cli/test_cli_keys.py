"""``kvgate keys create|list|revoke`` as an operator runs them, and ``kvgate serve`` with keys on and the
admin surface on its own listener (real processes, the embedded Redis, the official openai client)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.process.http_edge import free_port, running
from gateway.table.redis_server import EmbeddedRedis
from tests.cli.test_cli import kvgate, ok
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import until_healthy
from tests.support.stub_backend import StubState, build_stub


def test_keys_create_list_revoke_round_trip(tmp_path: Path) -> None:
    data = tmp_path / "kvgate"
    with EmbeddedRedis(data):  # started once: each command adopts it
        keys_round_trip(data)


def keys_round_trip(data: Path) -> None:
    created = ok("keys", "create", "--tenant", "acme", "--id", "tenant-42", "--id", "tenant-43", "--base",
                 data_dir=data)  # fmt: skip
    assert created["key"].startswith("kvg-")
    assert (created["tenant"], created["ids"], created["base"]) == ("acme", ["tenant-42", "tenant-43"], True)
    plain = kvgate("keys", "create", "--tenant", "bolt", "--id", "tenant-7", data_dir=data)
    assert plain.returncode == 0, plain.stderr
    (bolt_key,) = plain.stdout.split()  # the key alone on stdout (KEY=$(kvgate keys create ...))
    assert bolt_key.startswith("kvg-")
    assert "shown only once" in plain.stderr

    listed = ok("keys", "list", data_dir=data)["keys"]
    assert [(row["tenant"], row["ids"], row["base"]) for row in listed] == [
        ("acme", ["tenant-42", "tenant-43"], True),
        ("bolt", ["tenant-7"], False),
    ]
    assert listed[0]["key_id"] == created["key_id"]
    assert created["key"] not in str(listed)
    assert bolt_key not in str(listed)
    table = kvgate("keys", "list", data_dir=data)
    assert table.returncode == 0
    assert created["key_id"] in table.stdout
    assert "tenant-42, tenant-43" in table.stdout
    assert created["key"] not in table.stdout

    revoked = ok("keys", "revoke", created["key_id"], data_dir=data)
    assert (revoked["key_id"], revoked["tenant"]) == (created["key_id"], "acme")
    assert [row["tenant"] for row in ok("keys", "list", data_dir=data)["keys"]] == ["bolt"]
    again = kvgate("keys", "revoke", created["key_id"], data_dir=data)
    assert again.returncode == 2
    assert len(again.stderr.strip().splitlines()) == 1
    assert created["key_id"] in again.stderr


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("keys", "create", "--id", "tenant-42"), "--tenant"),
        (("keys", "create", "--tenant", "acme", "--id", "tenant@42"), "invalid logical ID"),
        (("keys", "create", "--tenant", "ac me", "--id", "tenant-42"), "invalid tenant"),
        (("keys", "create", "--tenant", "acme"), "at least one --id or --base"),
        (("keys", "revoke", "0123456789ab"), "no API key with id '0123456789ab'"),
    ],
)
def test_keys_bad_input_exits_2_with_one_line(args: tuple[str, ...], reason: str, tmp_path: Path) -> None:
    done = kvgate(*args, data_dir=tmp_path / "kvgate")
    assert done.returncode == 2, done.stderr
    assert reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""
    if args[1] == "create":
        assert not (tmp_path / "kvgate").exists(), "refused before the embedded Redis is even started"


async def test_serve_with_api_keys_and_an_admin_listener(make_adapter: MakeAdapter, tmp_path: Path) -> None:
    await serve_with_api_keys(make_adapter, tmp_path / "kvgate")  # each command uses the embedded Redis


async def serve_with_api_keys(make_adapter: MakeAdapter, data: Path) -> None:
    ok("publish", "tenant-42", str(make_adapter(b"v1")), data_dir=data)
    ok("publish", "tenant-43", str(make_adapter(b"v2")), data_dir=data)
    key = ok("keys", "create", "--tenant", "acme", "--id", "tenant-42", data_dir=data)["key"]
    stub = StubState()
    async with running(build_stub(stub)) as stub_url:
        port, admin_port = free_port(), free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--replica", stub_url, "--port", str(port),
                   "--auth", "api-keys", "--admin-port", str(admin_port),
                   "--data-dir", str(data), "--store", str(data / "store")]  # fmt: skip
        env = {**os.environ, "KVGATE_ADMIN_TOKEN": "admin-secret"}
        server = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE, env=env)
        try:
            url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
            await until_healthy(admin)
            async with aiohttp.ClientSession() as http:
                token = {"x-kvgate-admin-token": "admin-secret"}
                async with http.get(f"{url}/metrics") as response:
                    public_metrics = response.status
                async with http.get(f"{admin}/kvgate/status", headers=token) as response:
                    admin_status = response.status
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as api:
                completion = await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
                models = [m.id for m in (await api.models.list()).data]
                with pytest.raises(openai.NotFoundError):
                    await api.completions.create(model="tenant-43", prompt="p", max_tokens=1)
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="kvg-wrong", max_retries=0) as api:
                with pytest.raises(openai.AuthenticationError):
                    await api.completions.create(model="tenant-42", prompt="p", max_tokens=1)
        finally:
            server.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(server.communicate(), timeout=30)
    assert server.returncode == 0, err.decode()
    assert (public_metrics, admin_status) == (404, 200)
    assert completion.model == "tenant-42"
    assert models == ["tenant-42"]
    assert "Authorization" not in stub.received_headers[-1]
    assert f"admin listener on http://127.0.0.1:{admin_port}" in err.decode()
