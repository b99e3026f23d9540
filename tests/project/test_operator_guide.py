"""The operator guide's ``redis-cli --eval`` lines, and the README tour's, run as written (bash, Debian's
redis-cli) against a real embedded Redis: the bump and the rollback they make are the table's, and every
kvgate reads them in the change log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter, rollout_adapter
from gateway.adapters.store import AdapterStore
from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "operator-guide.md"
README = Path(__file__).resolve().parents[2] / "README.md"


def redis_cli_blocks(page: Path = GUIDE) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", page.read_text(), re.DOTALL)
    return [block for block in blocks if "redis-cli" in block and "--eval" in block]


def run(block: str, cwd: Path, data: Path) -> str:
    env = {**os.environ, "KVGATE_DATA_DIR": str(data), "KVGATE_STORE": str(data / "store"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_the_guides_redis_cli_bump_and_rollback_work_as_written(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    bump, rollback, *_ = redis_cli_blocks()
    data = tmp_path / "kvgate"
    (tmp_path / ".kvgate-guide").mkdir()
    with EmbeddedRedis(data) as server:
        async with Redis.from_url(server.url) as redis:
            table = EpochTable(redis)
            store = AdapterStore(data / "store")
            v1 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
            v2 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
            assert run(bump, tmp_path, data).split() == ["1", "3"]
            newest: Any = await redis.xrevrange(keys.LOG, count=1)  # what every kvgate follows
            ((_, logged),) = newest
            assert (logged[b"id"], logged[b"action"], logged[b"epoch"]) == (b"tenant-42", b"bump", b"3")
            state = await table.read_state("tenant-42")
            assert state is not None
            assert (state.digest, state.epoch) == (v2.digest, 3)

            out = run(rollback, tmp_path, data).split("\n")
            assert out[:3] == ["1", "4", v1.digest]
            assert "rollback" in out[4], "the block's `kvgate history` shows it"
            state = await table.read_state("tenant-42")
            assert state is not None
            assert (state.digest, state.epoch) == (v1.digest, 4)


async def test_the_readme_tours_redis_cli_bump_works_as_written(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    (bump,) = redis_cli_blocks(README)
    data = tmp_path / "kvgate"
    with EmbeddedRedis(data) as server:
        async with Redis.from_url(server.url) as redis:
            table = EpochTable(redis)
            store = AdapterStore(data / "store")
            await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
            v2 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
            out = run(bump, tmp_path, data).split("\n")
            assert out[:2] == ["1", "3"]
            assert "bump" in out[3], "the block's `kvgate history` shows it, newest first"
            state = await table.read_state("tenant-42")
            assert state is not None
            assert (state.digest, state.epoch) == (v2.digest, 3)


async def test_the_guides_redis_cli_rollout_weight_abort_and_promote_work_as_written(
    make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    _, _, weight, abort, promote = redis_cli_blocks()
    assert ["rollout_version" in weight, "abort_rollout" in abort, "promote_candidate" in promote] == [
        True
    ] * 3
    data = tmp_path / "kvgate"
    (tmp_path / ".kvgate-guide").mkdir()
    with EmbeddedRedis(data) as server:
        async with Redis.from_url(server.url) as redis:
            table = EpochTable(redis)
            store = AdapterStore(data / "store")
            v1 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
            v3 = await rollout_adapter(table, store, "tenant-42", make_adapter(b"v3"), "base", 500)
            assert run(weight, tmp_path, data).split() == ["1", "1", "5000", "user"]
            state = await table.read_state("tenant-42")
            assert state is not None
            assert state.candidate is not None
            assert (state.candidate.digest, state.candidate.weight) == (v3.digest, 5000)

            assert run(abort, tmp_path, data).split() == ["1", "1", v3.digest]
            newest: Any = await redis.xrevrange(keys.LOG, count=1)  # what every kvgate follows
            ((_, logged),) = newest
            assert (logged[b"action"], b"cand_digest" in logged) == (b"abort", False)
            state = await table.read_state("tenant-42")
            assert state is not None
            assert (state.digest, state.candidate) == (v1.digest, None)

            await rollout_adapter(table, store, "tenant-42", make_adapter(b"v3"), "base", 500)
            out = run(promote, tmp_path, data).split("\n")
            assert out[:3] == ["1", "2", v3.digest]
            assert "promote" in out[4], "the block's `kvgate history` shows it, newest first"
            state = await table.read_state("tenant-42")
            assert state is not None
            assert (state.digest, state.epoch, state.candidate) == (v3.digest, 2, None)
