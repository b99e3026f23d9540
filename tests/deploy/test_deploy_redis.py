"""``deploy/base/redis/configure.sh`` (each Redis pod's init step) run for real: three "pods" on this
machine, each a Debian ``redis-server`` and a sentinel configured by the script exactly as in the cluster,
only with local addresses and ports (the script's variables). The first start makes pod 0 the master and
the others its replicas; kvgate finds the master through the sentinels (``redis+sentinel://``); after the
master is killed and the sentinels fail over, the script run again for pod 0 makes it a replica of the new
master (not a second master), and kvgate follows.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from redis.asyncio import Redis

from gateway.process.http_edge import free_port
from gateway.table.connection import connect
from tests.support.conditions import eventually
from tests.support.redis_topologies import binary, texts

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "base" / "redis" / "configure.sh"
HOST = "127.0.0.1"
MASTER_SET = "kvgate"


@dataclass
class Pod:
    """One Redis pod's containers (redis-server, sentinel), as local processes in their own directory."""

    root: Path
    redis_port: int = field(default_factory=free_port)
    sentinel_port: int = field(default_factory=free_port)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def configure(self, pods: list[Pod]) -> str:
        """The init container: run configure.sh with this pod's addresses; its one line of output."""
        for part in ("conf", "data", "tmp"):
            (self.root / part).mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ["PATH"],
            "ME": HOST,
            "REDIS_PORT": str(self.redis_port),
            "SENTINEL_PORT": str(self.sentinel_port),
            "SENTINELS": " ".join(f"{HOST}:{pod.sentinel_port}" for pod in pods),
            "FIRST_MASTER": f"{HOST}:{pods[0].redis_port}",
            "DOWN_AFTER_MS": "1000",
            "FAILOVER_TIMEOUT_MS": "3000",
            "CONF": str(self.root / "conf"),
            "DATA": str(self.root / "data"),
            "SENTINEL_DIR": str(self.root / "tmp"),
        }
        done = subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def start(self, *which: str) -> None:
        """The containers' commands: redis-server on redis.conf, and on sentinel.conf --sentinel."""
        commands = {
            "redis": [binary("redis-server"), str(self.root / "conf" / "redis.conf")],
            "sentinel": [binary("redis-server"), str(self.root / "conf" / "sentinel.conf"), "--sentinel"],
        }
        for name in which:
            with (self.root / f"{name}.log").open("ab") as log:
                self.processes[name] = subprocess.Popen(
                    commands[name], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

    def kill(self, name: str) -> None:
        self.processes[name].kill()
        self.processes[name].wait(10)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    group = [Pod(tmp_path / f"redis-{n}") for n in range(3)]
    yield group
    for pod in group:
        for process in pod.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)


async def call(port: int, *command: Any) -> Any:
    """One command to the server on PORT, its reply decoded."""
    async with Redis(host=HOST, port=port, socket_timeout=5.0, socket_connect_timeout=2.0) as client:
        return texts(await client.execute_command(*command))  # type: ignore[no-untyped-call]


async def role(pod: Pod) -> list[Any]:
    found: list[Any] = await call(pod.redis_port, "ROLE")
    return found


async def answers(port: int) -> bool:
    try:
        return bool(await call(port, "PING"))
    except redis.exceptions.ConnectionError:
        return False


async def named_master(pod: Pod) -> int:
    """The master's port, as this pod's sentinel names it."""
    _host, port = await call(pod.sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_SET)
    return int(port)


async def sentinels_agree(pods: list[Pod], port: int) -> bool:
    """Every sentinel names PORT the master and knows the two replicas and the two other sentinels."""
    for pod in pods:
        replicas = await call(pod.sentinel_port, "SENTINEL", "REPLICAS", MASTER_SET)
        others = await call(pod.sentinel_port, "SENTINEL", "SENTINELS", MASTER_SET)
        if await named_master(pod) != port or len(replicas) != 2 or len(others) != 2:
            return False
    return True


async def kvgate_master_port(pods: list[Pod]) -> int:
    """Where kvgate's Sentinel client writes (the URL form the manifests use)."""
    url = "redis+sentinel://" + ",".join(f"{HOST}:{pod.sentinel_port}" for pod in pods) + f"/{MASTER_SET}"
    async with connect(url, answer_within=2) as client:
        await client.set("kvg:deploy-probe", "1")
        port = int(texts(await client.config_get("port"))["port"])
        return port


async def test_configure_script_bootstraps_then_rejoins_after_failover(pods: list[Pod]) -> None:
    first, *others = pods
    # First start, in the StatefulSet's order: nobody answers pod 0, so it is the master; each next pod
    # hears of it from the sentinels already running.
    for pod in pods:
        line = pod.configure(pods)
        assert line.endswith(f"master {HOST}:{first.redis_port}"), line
        pod.start("redis", "sentinel")

        async def up(pod: Pod = pod) -> bool:
            return await answers(pod.redis_port) and await answers(pod.sentinel_port)

        await eventually(up, f"{pod.root.name} answers", within=15)
    assert (await role(first))[0] == "master"
    assert "replicaof" not in (first.root / "conf" / "redis.conf").read_text()
    for pod in others:
        assert (await role(pod))[0] == "slave"

    async def bootstrapped() -> bool:
        return await sentinels_agree(pods, first.redis_port)

    await eventually(bootstrapped, "all three sentinels see the master, 2 replicas and each other", 40)
    assert await kvgate_master_port(pods) == first.redis_port

    # The master dies; the sentinels promote one of the replicas.
    first.kill("redis")

    async def failed_over() -> bool:
        return await named_master(first) != first.redis_port

    await eventually(failed_over, "the sentinels promote a replica", within=30)
    promoted = await named_master(first)
    new_master = next(pod for pod in others if pod.redis_port == promoted)

    # Pod 0 restarts: its init step asks the sentinels and rejoins as a replica of the new master.
    line = first.configure(pods)
    assert line.endswith(f"master {HOST}:{new_master.redis_port}"), line
    assert f"replicaof {HOST} {new_master.redis_port}" in (first.root / "conf" / "redis.conf").read_text()
    first.start("redis")

    async def rejoined() -> bool:
        """Pod 0 replicates the master the sentinels name now: on a busy machine they may fail over once
        more (seen: the promoted replica judged down in turn, and another one promoted), and pod 0's
        sentinel then points it at that one."""
        try:
            found = await role(first)
            named = await named_master(first)
        except redis.exceptions.ConnectionError:
            return False
        return bool(found[0] == "slave" and found[2] == named and found[3] == "connected")

    await eventually(rejoined, "pod 0 replicates the master the sentinels name", within=60)
    assert await kvgate_master_port(pods) == await named_master(first)  # after a second failover too
