"""``kvgate agent`` against a real S3 API server (moto's, a process): fetch, verify, rename; single-flight;
the disk budget; and every fault refused with nothing partial and nothing unverified at a digest's path.

The replica beside the agent is the stub backend (its ``/v1/models`` is all the agent reads of it); the
real-vLLM test is tests/vllm/test_agent_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import obstore
import pytest
from blake3 import blake3

from gateway.adapters.objclient import STALL_S, open_client
from gateway.adapters.objstore import ObjectStore
from gateway.adapters.store import INCOMING_PREFIX
from gateway.agent.fetch import STAMPS
from gateway.agent.server import FETCHER, build_agent
from gateway.core.identity import scan_adapter, tree_digest
from gateway.process.http_edge import free_port, running
from tests.support.adapter_files import MakeAdapter
from tests.support.conditions import STARTS_WITHIN_S, eventually
from tests.support.s3_server import S3Server, environment, silent_endpoint
from tests.support.stub_backend import StubState, build_stub

TOKEN = "agent-test-token"
Agent = Callable[..., AbstractAsyncContextManager[tuple[str, Any]]]


@pytest.fixture
def stub_state() -> StubState:
    return StubState()


@pytest.fixture
def agent(s3_url: str, tmp_path: Path, stub_state: StubState) -> Agent:
    """An agent in this process (its HTTP server), beside a stub replica; yields (url, its Fetcher)."""

    @asynccontextmanager
    async def start(root: Path | None = None, **overrides: Any) -> AsyncIterator[tuple[str, Any]]:
        async with running(build_stub(stub_state)) as replica:
            options: dict[str, Any] = {"token": TOKEN, "replica_url": replica, "agent_root": "/adapters",
                                       "disk_bytes": 1 << 30} | overrides  # fmt: skip
            app = build_agent(s3_url, root or tmp_path / "local", **options)
            async with running(app) as url:
                yield url, app[FETCHER]

    return start


async def ask(url: str, digest: str, token: str = TOKEN) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/v1/fetch", json={"digest": digest}, headers={"Authorization": f"Bearer {token}"}
        ) as r,
    ):
        return r.status, await r.json()


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/healthz") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


def mount(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name != STAMPS)


async def test_a_fetch_is_verified_renamed_into_place_and_answered(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    source = make_adapter(b"weights-v1", extra={"sub/x.bin": b"x"})
    stored = ObjectStore(s3_url).ingest(source)
    async with agent() as (url, fetcher):
        status, body = await ask(url, stored.digest)
        assert status == 200, body
        assert body == {"digest": stored.digest, "path": f"/adapters/{stored.digest}"}
        local = tmp_path / "local" / stored.digest
        assert tree_digest(local, scan_adapter(local)) == stored.digest
        assert (local / "sub" / "x.bin").read_bytes() == b"x"
        assert stat.S_IMODE((local / "adapter_model.safetensors").stat().st_mode) == 0o444
        assert (await ask(url, stored.digest))[0] == 200
        assert (fetcher.counts["fetched"], fetcher.counts["cached"]) == (1, 1)
        assert (await ask(url, stored.digest, token="wrong"))[0] == 401
        status, body = await ask(url, "../../etc")
        assert status == 400, body
        assert leftovers(tmp_path / "local") == []


async def test_concurrent_asks_for_one_digest_fetch_once(
    agent: Agent, s3: S3Server, s3_url: str, make_adapter: MakeAdapter
) -> None:
    stored = ObjectStore(s3_url).ingest(make_adapter(os.urandom(3 << 20)))
    async with agent() as (url, fetcher):
        answers = await asyncio.gather(*(ask(url, stored.digest) for _ in range(6)))
        assert [status for status, _ in answers] == [200] * 6
        assert fetcher.counts["fetched"] == 1
    gets = [line for line in s3.log.read_text().splitlines()
            if "GET " in line and f"{stored.digest}/adapter_model.safetensors" in line]  # fmt: skip
    assert len(gets) == 1, gets


def tamper(store: ObjectStore, digest: str, how: str) -> None:
    key = f"{digest}/adapter_model.safetensors"
    original = bytes(obstore.get(store.client, key).bytes())
    if how == "changed":
        obstore.put(store.client, key, bytes([original[0] ^ 1]) + original[1:])  # same size, other bytes
    elif how == "truncated":
        obstore.put(store.client, key, original[: len(original) // 2])
    elif how == "missing":
        obstore.delete(store.client, key)
    elif how == "bad-manifest":
        obstore.put(store.client, f"{digest}.json", b'{"format": "kvgate-manifest-v1", "files": []}')


@pytest.mark.parametrize("how", ["changed", "truncated", "missing", "bad-manifest"])
async def test_bytes_changed_after_publish_are_refused_with_nothing_left(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path, how: str
) -> None:
    store = ObjectStore(s3_url)
    stored = store.ingest(make_adapter(os.urandom(100_000)))
    tamper(store, stored.digest, how)
    async with agent() as (url, fetcher):
        status, body = await ask(url, stored.digest)
        assert status == 503, body
        assert body["error"]["code"] == how
        assert fetcher.counts[how] == 1
    assert not (tmp_path / "local" / stored.digest).exists(), "nothing unverified at the digest's path"
    assert leftovers(tmp_path / "local") == [], "no partial directory"


@pytest.mark.parametrize("how", ["refused", "silent"])
async def test_an_unreachable_object_store_is_refused(
    agent: Agent, s3: S3Server, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path, how: str
) -> None:
    """A store that refuses connections, or accepts them and never answers (within its deadline)."""
    stored = ObjectStore(s3_url).ingest(make_adapter(b"v1"))
    with contextlib.ExitStack() as stack:
        endpoint = "http://127.0.0.1:9" if how == "refused" else stack.enter_context(silent_endpoint())
        with environment({"AWS_ENDPOINT_URL": endpoint}):
            nowhere = open_client(s3_url)
        async with agent(client=nowhere) as (url, _):
            started = time.monotonic()
            status, body = await ask(url, stored.digest)
            took = time.monotonic() - started
    assert status == 503, body
    assert body["error"]["code"] == "unreachable"
    assert body["error"]["message"].startswith("reading the manifest failed: "), body
    assert took < STALL_S + 10, f"the deadline held: {took:.1f} s"
    assert list((tmp_path / "local").iterdir()) == []


async def test_a_full_disk_is_refused_with_no_partial_directory(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """A real full file system: a 256 KiB tmpfs (the tests run as root, as CI does)."""
    small = tmp_path / "small"
    small.mkdir()
    mount(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)])
    try:
        stored = ObjectStore(s3_url).ingest(make_adapter(os.urandom(1 << 20)))
        async with agent(root=small) as (url, fetcher):
            status, body = await ask(url, stored.digest)
            assert status == 503, body
            assert body["error"]["code"] == "disk-full"
            assert fetcher.counts["disk-full"] == 1
        assert list(small.iterdir()) == []
    finally:
        mount(["umount", str(small)])


async def test_the_disk_budget_evicts_the_least_recently_asked_never_a_loaded_one(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path, stub_state: StubState
) -> None:
    store = ObjectStore(s3_url)
    a, b, c, d = (store.ingest(make_adapter(os.urandom(40_000))) for _ in range(4))
    async with agent(disk_bytes=100_000, hold_s=0.0) as (url, fetcher):
        for version in (a, b):
            assert (await ask(url, version.digest))[0] == 200
        stub_state.adapters["t@a"] = f"/adapters/{a.digest}"  # the replica has A loaded: never evicted
        assert (await ask(url, c.digest))[0] == 200
        assert sorted(fetcher.local()) == sorted([a.digest, c.digest]), "B went (A is older, but loaded)"
        stub_state.adapters["t@c"] = f"/adapters/{c.digest}"
        status, body = await ask(url, d.digest)
        assert status == 503, body
        assert body["error"]["code"] == "budget"
        assert sorted(fetcher.local()) == sorted([a.digest, c.digest])
    assert leftovers(tmp_path / "local") == []


async def test_an_agent_restarted_mid_fetch_leaves_nothing_and_fetches_again(
    s3: S3Server, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    stored = ObjectStore(s3_url).ingest(make_adapter(os.urandom(96 << 20)))
    root = tmp_path / "local"
    port = free_port()
    env = os.environ | {"KVGATE_AGENT_TOKEN": TOKEN}
    command = [sys.executable, "-m", "gateway.cli", "agent", "--store", s3_url, "--agent-dir", str(root),
               "--agent-port", str(port), "--agent-root", "/adapters"]  # fmt: skip

    async def started() -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.DEVNULL)

        await eventually(
            lambda: healthy(f"http://127.0.0.1:{port}"), "the agent answers /healthz", within=STARTS_WITHIN_S
        )
        return process

    first = await started()
    asking = asyncio.ensure_future(ask(f"http://127.0.0.1:{port}", stored.digest))
    await eventually(
        lambda: any(p.name.startswith(INCOMING_PREFIX) for p in root.iterdir()), "a fetch under way"
    )
    first.kill()
    await first.wait()
    with pytest.raises(aiohttp.ClientError):
        await asking
    assert not (root / stored.digest).exists()
    second = await started()
    try:
        assert leftovers(root) == [], "the incoming directory is gone at the next start"
        status, body = await ask(f"http://127.0.0.1:{port}", stored.digest)
        assert status == 200, body
        assert tree_digest(root / stored.digest, scan_adapter(root / stored.digest)) == stored.digest
    finally:
        second.terminate()
        await second.wait()


async def test_the_loop_answers_while_a_fetch_waits_on_its_disk(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch writes and fsyncs in worker threads: with one held in a file's fsync (a slow disk), the
    agent still answers /healthz and hands out a copy it has."""
    store = ObjectStore(s3_url)
    ready, slow = (store.ingest(make_adapter(os.urandom(100_000))) for _ in range(2))
    held, release, expired = threading.Event(), threading.Event(), threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode) and not release.is_set():
            held.set()
            if not release.wait(10):  # on the loop's thread this holds the loop: nothing answers
                expired.set()
        real_fsync(fd)

    async with agent() as (url, _):
        assert (await ask(url, ready.digest))[0] == 200
        monkeypatch.setattr(os, "fsync", fsync)
        fetching = asyncio.ensure_future(ask(url, slow.digest))
        try:
            await eventually(held.is_set, "the fetch waits in its fsync")
            assert await healthy(url)
            assert (await ask(url, ready.digest))[0] == 200
            assert not expired.is_set(), "the agent answered only once the fsync was let go"
        finally:
            release.set()
        status, body = await fetching
        assert status == 200, body


async def test_a_fetch_hashes_each_byte_once_off_the_loop(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes are hashed as they stream in, in worker threads, and never read back for a second pass."""
    hashed: list[tuple[int, int]] = []  # (thread, bytes) of every hashing call

    class Recorded:
        """blake3 itself, recording where and how much it hashes."""

        AUTO = blake3.AUTO

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.real = blake3(*args, **kwargs)

        def update(self, data: bytes) -> Recorded:
            hashed.append((threading.get_ident(), len(memoryview(data))))
            self.real.update(data)
            return self

        def update_mmap(self, path: str) -> Recorded:
            hashed.append((threading.get_ident(), os.path.getsize(path)))
            self.real.update_mmap(path)
            return self

        def hexdigest(self) -> str:
            return self.real.hexdigest()

        def digest(self) -> bytes:
            return self.real.digest()

    source = make_adapter(os.urandom(3 << 20))
    size = sum(p.stat().st_size for p in source.iterdir())
    stored = ObjectStore(s3_url).ingest(source)
    async with agent() as (url, _):
        monkeypatch.setattr("gateway.agent.fetch.blake3", Recorded)
        monkeypatch.setattr("gateway.core.identity.blake3", Recorded)
        status, body = await ask(url, stored.digest)
        assert status == 200, body
    assert sum(n for _, n in hashed) == size, "one pass: each byte hashed once"
    assert threading.get_ident() not in {thread for thread, _ in hashed}, "none on the loop's thread"


def file_clock(where: Path) -> int:
    """The ctime a file changed now gets."""
    probe = where / "clock"
    probe.touch()
    os.utime(probe)
    return probe.stat().st_ctime_ns


def alter(local: Path, how: str) -> None:
    weights = local / "adapter_model.safetensors"
    if how == "rewritten":  # other bytes, same size, its mtime put back: only its ctime tells
        before = weights.stat()
        data = weights.read_bytes()
        weights.chmod(0o644)
        weights.write_bytes(bytes([data[0] ^ 1]) + data[1:])
        weights.chmod(0o444)
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert weights.stat().st_ctime_ns != before.st_ctime_ns
    elif how == "added":
        (local / "sneaked-in.bin").write_bytes(b"x")
    elif how == "unstamped":  # a copy this agent did not stamp (an older agent's, or a lost stamp)
        (local.parent / STAMPS / f"{local.name}.json").unlink()


@pytest.mark.parametrize("how", ["rewritten", "added", "unstamped"])
async def test_a_cached_copy_altered_on_disk_is_fetched_again_never_served(
    agent: Agent, s3_url: str, make_adapter: MakeAdapter, tmp_path: Path, how: str
) -> None:
    stored = ObjectStore(s3_url).ingest(make_adapter(os.urandom(100_000)))
    local = tmp_path / "local" / stored.digest
    async with agent() as (url, fetcher):
        assert (await ask(url, stored.digest))[0] == 200
        fetched = max(p.lstat().st_ctime_ns for p in [local, *local.rglob("*")])
        await eventually(  # file times come from a coarse clock: let it pass the fetch's before altering
            lambda: file_clock(tmp_path) > fetched, "the file clock moved on"
        )
        alter(local, how)
        status, body = await ask(url, stored.digest)
        assert status == 200, body
        assert tree_digest(local, scan_adapter(local)) == stored.digest, "what is handed out is the version"
        assert (fetcher.counts["altered"], fetcher.counts["fetched"]) == (1, 2)
        assert (await ask(url, stored.digest))[0] == 200
        assert (fetcher.counts["cached"], fetcher.counts["fetched"]) == (1, 2), "the new copy is stamped"
    assert leftovers(tmp_path / "local") == []
