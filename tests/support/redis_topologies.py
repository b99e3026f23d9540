"""Real Redis topologies for the failover tests: Debian's ``redis-server`` and ``redis-sentinel``.

``sentinel_group``: a master, one replica and three sentinels (quorum 2, ``down-after-milliseconds`` 1000,
``failover-timeout`` 3000), yielded once every sentinel knows the replica and the other sentinels.
``redis_cluster``: three cluster-enabled masters sharing the 16384 slots, and one replica of the first
master, yielded once every node says ``cluster_state:ok``. Each server runs in its own directory under the
test's temporary directory, on ports from ``free_port``; nothing here touches a system ``redis-server``.
``make test`` installs the binaries (the Makefile's ``.cache/apt-redis.done``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.exceptions
from redis.asyncio import Redis

from gateway.process.http_edge import free_port
from tests.support.conditions import eventually

MASTER_NAME = "kvgate-main"
HOST = "127.0.0.1"
SLOTS = 16384
START_WITHIN = 15.0


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: `make test` installs Debian's redis-server and redis-sentinel")
    return found


@dataclass
class ServerProcess:
    """One ``redis-server`` (or ``redis-sentinel``) with its config, data and log in its own directory."""

    directory: Path
    config: list[str]
    program: str = "redis-server"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "redis.conf"  # a sentinel rewrites its config file: it must be writable
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            "protected-mode no",
            f"dir {self.directory}",
            "repl-diskless-sync-delay 0",
        ]
        conf.write_text("\n".join([*lines, 'save ""', "appendonly no", *self.config]) + "\n")
        with (self.directory / "server.log").open("ab") as log:
            self.process = subprocess.Popen(
                [binary(self.program), str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-flight, as a crashed host's would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def pause(self) -> None:
        """SIGSTOP: alive to the kernel (connections stay open) but answering nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def client(self) -> Redis:
        return Redis(host=HOST, port=self.port, socket_timeout=5.0, socket_connect_timeout=2.0)

    async def call(self, *command: Any) -> Any:
        async with self.client() as client:
            return await client.execute_command(*command)  # type: ignore[no-untyped-call]

    async def answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            tail = (self.directory / "server.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.program} on port {self.port} exited:\n{tail}")
        try:
            return bool(await self.call("PING"))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
            return False  # not listening yet

    async def info(self, section: str) -> dict[str, Any]:
        async with self.client() as client:
            info: dict[str, Any] = await client.info(section)
            return info


async def started(servers: list[ServerProcess]) -> None:
    for server in servers:
        server.start()
    for server in servers:
        await eventually(server.answers, f"{server.program} answers on port {server.port}", START_WITHIN)


@contextlib.asynccontextmanager
async def stopping(servers: list[ServerProcess]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                server.resume()  # a paused server cannot act on SIGTERM
            server.stop()


def texts(value: Any) -> Any:
    """Redis replies with bytes decoded, at any depth."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [texts(item) for item in value]
    if isinstance(value, dict):
        return {texts(key): texts(item) for key, item in value.items()}
    return value


@dataclass
class SentinelGroup:
    master: ServerProcess
    replica: ServerProcess
    sentinels: list[ServerProcess]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}"

    async def master_ports(self) -> set[int]:
        """The master's port as each live sentinel reports it."""
        ports = set()
        for sentinel in self.sentinels:
            _host, port = texts(await sentinel.call("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME))
            ports.add(int(port))
        return ports

    async def replicating(self) -> bool:
        return bool((await self.replica.info("replication")).get("master_link_status") == "up")

    async def ready(self) -> bool:
        for sentinel in self.sentinels:
            replicas = texts(await sentinel.call("SENTINEL", "REPLICAS", MASTER_NAME))
            others = texts(await sentinel.call("SENTINEL", "SENTINELS", MASTER_NAME))
            if len(replicas) != 1 or len(others) != len(self.sentinels) - 1:
                return False
        return True


@contextlib.asynccontextmanager
async def sentinel_group(root: Path) -> AsyncIterator[SentinelGroup]:
    master = ServerProcess(root / "master", [])
    replica = ServerProcess(root / "replica", [f"replicaof {HOST} {master.port}"])
    watch = [
        f"sentinel monitor {MASTER_NAME} {HOST} {master.port} 2",
        f"sentinel down-after-milliseconds {MASTER_NAME} 1000",
        f"sentinel failover-timeout {MASTER_NAME} 3000",
        f"sentinel parallel-syncs {MASTER_NAME} 1",
    ]
    sentinels = [ServerProcess(root / f"sentinel-{i}", watch, program="redis-sentinel") for i in range(3)]
    group = SentinelGroup(master, replica, sentinels)
    servers = [master, replica, *sentinels]
    async with stopping(servers):
        await started([master, replica])
        # Sentinels learn of replicas from the master's INFO, which they read at once and then every
        # 10 s: started after the replica is in sync, they see it on their first read.
        await eventually(group.replicating, "the replica is in sync with the master", START_WITHIN)
        await started(sentinels)
        await eventually(group.ready, "sentinels see the replica and each other", 30.0)
        yield group


@dataclass
class ClusterNodes:
    masters: list[ServerProcess]
    replica: ServerProcess
    """A replica of ``masters[0]``: writes to its slots wait for its acknowledgement."""

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.masters[0].port},{HOST}:{self.masters[1].port}"

    @property
    def nodes(self) -> list[ServerProcess]:
        return [*self.masters, self.replica]

    async def ok(self) -> bool:
        for node in self.nodes:
            info = texts(await node.call("CLUSTER", "INFO"))
            if "cluster_state:ok" not in info or f"cluster_known_nodes:{len(self.nodes)}" not in info:
                return False
        role = texts(await self.masters[0].call("ROLE"))
        return len(role[2]) == 1 and (await self.replica.info("replication"))["master_link_status"] == "up"

    async def owner(self, key: str) -> ServerProcess:
        """The master serving KEY's slot, as the cluster itself says (``CLUSTER SHARDS``)."""
        slot = int(await self.masters[0].call("CLUSTER", "KEYSLOT", key))
        for shard in texts(await self.masters[0].call("CLUSTER", "SHARDS")):
            ranges = shard["slots"]
            if any(first <= slot <= last for first, last in zip(ranges[::2], ranges[1::2], strict=True)):
                (port,) = [node["port"] for node in shard["nodes"] if node["role"] == "master"]
                (master,) = [master for master in self.masters if master.port == port]
                return master
        raise AssertionError(f"no master serves slot {slot}")


@contextlib.asynccontextmanager
async def redis_cluster(root: Path) -> AsyncIterator[ClusterNodes]:
    def node(name: str) -> ServerProcess:
        bus = free_port()  # set explicitly: the default (port + 10000) may be past 65535
        settings = ["cluster-enabled yes", "cluster-config-file nodes.conf", f"cluster-port {bus}"]
        return ServerProcess(root / name, [*settings, "cluster-node-timeout 2000"])

    masters = [node(f"master-{i}") for i in range(3)]
    cluster = ClusterNodes(masters, node("replica-0"))
    async with stopping(cluster.nodes):
        await started(cluster.nodes)
        for i, master in enumerate(masters):  # slots split evenly, in order
            first, last = i * SLOTS // len(masters), (i + 1) * SLOTS // len(masters) - 1
            await master.call("CLUSTER", "ADDSLOTSRANGE", first, last)
            await master.call("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for other in cluster.nodes[1:]:
            bus = int(texts(await other.call("CONFIG", "GET", "cluster-port"))["cluster-port"])
            await masters[0].call("CLUSTER", "MEET", HOST, other.port, bus)
        first_id = texts(await masters[0].call("CLUSTER", "MYID"))

        async def replica_attached() -> bool:
            with contextlib.suppress(Exception):  # until the replica has heard of the master
                await cluster.replica.call("CLUSTER", "REPLICATE", first_id)
                return True
            return False

        await eventually(replica_attached, "the replica follows the first master", START_WITHIN)
        await eventually(cluster.ok, "every node says cluster_state:ok", 30.0)
        yield cluster


async def kvgate_cli(*args: str) -> str:
    """``kvgate ARGS`` as a child process (the event loop keeps serving meanwhile); its standard output."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0, err.decode()
    return out.decode()
