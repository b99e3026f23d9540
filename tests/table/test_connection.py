"""Redis URLs: every kind kvgate accepts, what each part means, and one clear line for a bad one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis.exceptions
from redis.asyncio import Redis

from gateway.core.errors import BadRequest
from gateway.process.http_edge import free_port
from gateway.table.connection import RedisTarget, connect, parse_target
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter


def test_a_sentinel_url_names_the_sentinels_the_master_and_its_database() -> None:
    target = parse_target("redis+sentinel://:s3cret@10.0.0.1:26380,10.0.0.2,[::1]:26381/main/2")
    assert target == RedisTarget(
        "redis+sentinel",
        (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 26381)),
        master="main",
        db=2,
        password="s3cret",
    )
    assert "s3cret" not in repr(target)


def test_sentinels_can_have_their_own_credentials() -> None:
    url = "redis+sentinel://app:p%40ss@h1:1,h2:2/main?sentinel_username=watch&sentinel_password=w%26tch"
    target = parse_target(url)
    assert (target.username, target.password, target.master, target.db) == ("app", "p@ss", "main", 0)
    assert (target.sentinel_username, target.sentinel_password) == ("watch", "w&tch")


def test_a_cluster_url_lists_seed_nodes() -> None:
    target = parse_target("redis+cluster://user:pw@n1:7000,n2/")
    assert target == RedisTarget(
        "redis+cluster", (("n1", 7000), ("n2", 6379)), username="user", password="pw"
    )
    assert parse_target("redis+cluster://n1:7000/0").nodes == (("n1", 7000),)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h1:26379", "give the master's name after the sentinels"),
        ("redis+sentinel://h1:26379/main/zero", "the database after the master's name is a number"),
        ("redis+sentinel://h1:26379/main/0/extra", "give the master's name after the sentinels"),
        ("redis+sentinel://h1:notaport/main", "bad HOST[:PORT] 'h1:notaport'"),
        ("redis+sentinel://h1:26379,,h2/main", "without empty entries"),
        ("redis+sentinel:///main", "without empty entries"),
        ("redis+sentinel://h1/main?sentinel_pasword=x", "unknown option sentinel_pasword"),
        ("redis+cluster://n1:7000/3", "a cluster has only database 0"),
        ("redis+cluster://n1:7000?db=1", "takes no query options"),
        ("redis+cluster://n1:7000#x", "no #fragment"),
        ("http://h1:6379", "unsupported Redis URL scheme http://"),
        ("h1:6379", "redis URL has no scheme"),
    ],
)
def test_a_bad_url_is_one_clear_error(url: str, says: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_target(url)
    assert says in caught.value.message
    assert "\n" not in caught.value.message


def test_passwords_stay_out_of_messages() -> None:
    with pytest.raises(BadRequest) as caught:
        parse_target("redis+sentinel://:s3cret@h1:bad/main")
    assert "s3cret" not in caught.value.message


async def test_a_plain_url_is_redis_py_s_own(redis_server: EmbeddedRedis) -> None:
    async with connect(redis_server.url) as plain:
        assert isinstance(plain, Redis)
        assert await plain.ping()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "redis+sentinel://:s3cret@127.0.0.1:{port}/main",
            "no sentinel answers with a live master named 'main'",
        ),
        ("redis+cluster://:s3cret@127.0.0.1:{port}", "no listed node answers as a Redis Cluster"),
    ],
)
async def test_nobody_answering_is_one_line_at_connect(url: str, says: str) -> None:
    port = free_port()
    with pytest.raises(redis.exceptions.ConnectionError) as caught:
        async with connect(url.format(port=port)):
            pytest.fail("connected to nothing")
    message = str(caught.value)
    assert message.startswith(f"{url.split('://')[0]}://127.0.0.1:{port}: {says}")
    assert "\n" not in message
    assert "s3cret" not in message


def test_the_cli_refuses_a_bad_url_in_one_line_and_stores_nothing(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    command = [sys.executable, "-m", "gateway.cli", "publish", "tenant-42", str(make_adapter(b"v1")),
               "--store", str(store), "--redis-url", "redis+sentinel://:s3cret@h1:26379"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kvgate publish: bad redis+sentinel:// URL: give the master's name after the sentinels: "
        ".../MASTER or .../MASTER/DB"
    ]
    assert not store.exists() or not any(store.iterdir())
