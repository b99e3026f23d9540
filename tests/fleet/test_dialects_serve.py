"""The SGLang and generic dialects through a running ``kvgate serve --backend ...`` (its own process, real
Redis), each stub recording what it got.

SGLang, against SGLang-speaking stubs (``tests/support/stub_sglang.py``): the versioned name and kvgate's
namespace in ``extra_key`` (a client's own ``extra_key``/``cache_salt`` never reaching it), a publish then
a request served by the new version, ``purge-all`` calling ``/flush_cache``, the base fingerprint probe
keeping a replica of another base apart, and the canary catching a replica that serves other bytes under
a versioned name. Publishing is ``kvgate publish --backend sglang``, also a process.

Generic, against the vLLM-speaking stub (``tests/support/stub_backend.py``) used as a server whose adapters
are
fixed at start: what the ``backend`` setting's description promises (warnings at start, no load, no
namespace, no unload, a new version served once a replica is restarted with it, ``purge-all`` refused).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from redis.asyncio import Redis

from gateway.core.wire import ADMIN_TOKEN_HEADER, cache_salt
from gateway.process.http_edge import free_port, running
from gateway.settings.flags import flag
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter, swap_back, swap_bytes
from tests.support.conditions import eventually, until_healthy
from tests.support.stub_backend import StubState, build_stub
from tests.support.stub_sglang import SglangStubState, adapter_text, run_sglang_stub

pytestmark = pytest.mark.timeout(120)
TOKEN = "test-admin-token"
# One worker: /kvgate/status (the canary's audits, the quarantine) is the answering worker's own, and the
# ID is active (audited) only in the worker its request reached; with one per core, a status read could
# reach the other one (a KeyError on the audits, seen once in a full run).
SERVE = {
    "backend": "sglang", "poll_interval": 0.1, "reconcile_interval": 0.1, "drain_grace": 0.2, "workers": 1,
}  # fmt: skip
PROMPT = "The boats came in at dawn"
Labels = frozenset[tuple[str, str]]
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def labels(**values: str) -> Labels:
    return frozenset(values.items())


@dataclass(frozen=True)
class Kvgate:
    url: str
    admin_url: str
    log: Path

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    async def admin(self, path: str) -> str:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{self.admin_url}{path}", headers={ADMIN_TOKEN_HEADER: TOKEN}) as response,
        ):
            assert response.status == 200, await response.text()
            return await response.text()

    async def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(await self.admin("/kvgate/status"))
        return doc

    async def samples(self, name: str) -> dict[Labels, float]:
        """Every sample of metric ``name`` with a non-zero value, by its labels."""
        found = {}
        for line in (await self.admin("/metrics")).splitlines():
            if line.startswith(name + "{"):
                labels, value = line[len(name) :].rsplit(" ", 1)
                if float(value):
                    found[frozenset(_LABEL.findall(labels))] = float(value)
        return found


async def kvgate_cli(*args: str) -> dict[str, Any]:
    """A one-shot ``kvgate ... --json`` in a child process (the stubs keep serving on this event loop)."""
    command = [sys.executable, "-m", "gateway.cli", *args, "--json"]
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    doc: dict[str, Any] = json.loads(out)
    return doc


@asynccontextmanager
async def kvgate_serve(
    redis_server: EmbeddedRedis, store: Path, replicas: list[str], log: Path, **settings: object
) -> AsyncIterator[Kvgate]:
    """``kvgate serve`` as its own process, its admin surface (status, metrics) on a listener of its own."""
    port, admin_port = free_port(), free_port()
    options = [arg for name, value in (SERVE | settings).items() for arg in (flag(name), str(value))]
    command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--admin-port",
               str(admin_port), "--redis-url", redis_server.url, "--store", str(store),
               *(arg for url in replicas for arg in ("--replica", url)), *options]  # fmt: skip
    env = {**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN}
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(*command, env=env, stderr=stderr)
    try:
        url = f"http://127.0.0.1:{port}"
        await until_healthy(url)
        yield Kvgate(url, f"http://127.0.0.1:{admin_port}", log)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def publish(
    redis_server: EmbeddedRedis,
    store: Path,
    logical_id: str,
    adapter: Path,
    replicas: list[str],
    backend: str = "sglang",
) -> dict[str, Any]:
    """``kvgate publish --backend sglang``: it fingerprints the base through the stubs (SGLang dialect)."""
    urls = [arg for url in replicas for arg in ("--replica", url)]
    return await kvgate_cli("publish", logical_id, str(adapter), "--backend", backend, "--redis-url",
                            redis_server.url, "--store", str(store), *urls)  # fmt: skip


async def expected_salt(table: EpochTable, logical_id: str) -> str:
    """The namespace kvgate must give ``logical_id``'s current version: read from Redis, not kvgate."""
    version = await table.read_state(logical_id)
    assert version is not None
    return cache_salt(await table.ensure_generation(), version)


def bodies(*states: SglangStubState, model: str) -> list[dict[str, Any]]:
    """What the stubs received for ``model`` on the test's prompt (not the canary's own requests)."""
    return [b for s in states for b in s.received if b.get("model") == model and b.get("prompt") == PROMPT]


@asynccontextmanager
async def stubs(*states: SglangStubState) -> AsyncIterator[list[str]]:
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(run_sglang_stub(state)) for state in states]


async def ask(api: openai.AsyncOpenAI, model: str, **extra: Any) -> str:
    answer = await api.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra or None
    )
    return answer.choices[0].text


@pytest.mark.parametrize("lists_adapters", [True, False], ids=["newer-sglang", "older-sglang"])
async def test_versioned_names_and_namespaces_reach_sglang_and_a_publish_is_served_by_the_new_version(
    redis: Redis,
    redis_server: EmbeddedRedis,
    table: EpochTable,
    make_adapter: MakeAdapter,
    tmp_path: Path,
    lists_adapters: bool,
) -> None:
    """Older SGLang lists only the base in /v1/models: the dialect then lists from its load answers."""
    a, b = SglangStubState(list_adapters=lists_adapters), SglangStubState(list_adapters=lists_adapters)
    store, sources = tmp_path / "store", [make_adapter(b"v1"), make_adapter(b"v2")]
    async with stubs(a, b) as urls:
        v1 = await publish(redis_server, store, "t", sources[0], urls)
        assert v1["base_print"], "kvgate publish fingerprinted the base through SGLang's API"
        assert a.probes, "a was probed"
        assert b.probes, "b was probed"
        async with (
            kvgate_serve(redis_server, store, urls, tmp_path / "kvgate.log") as kvgate,
            kvgate.client() as api,
        ):
            text_v1 = await ask(api, "t", extra_key="client-key", cache_salt="client-salt")
            assert text_v1 == adapter_text(sources[0]), "v1's bytes answer (read from its source)"
            salt_v1 = await expected_salt(table, "t")
            [body] = bodies(a, b, model=v1["name"])
            assert body["extra_key"] == salt_v1, "kvgate's namespace, not the client's"
            assert "cache_salt" not in body, "a client's cache_salt never reaches SGLang"
            loads = [load for s in (a, b) for load in s.loads]
            assert loads == [{"lora_name": v1["name"], "lora_path": v1["path"], "pinned": False}]
            await ask(api, "base", extra_key="client-key", cache_salt="client-salt")
            [base_body] = bodies(a, b, model="base")
            assert "extra_key" not in base_body, "no base namespace without keys"
            assert "cache_salt" not in base_body

            v2 = await publish(redis_server, store, "t", sources[1], urls)
            assert v2["name"] != v1["name"]

            async def served_by_v2() -> bool:
                await ask(api, "t")
                return bool(bodies(a, b, model=v2["name"]))

            await eventually(served_by_v2, "a request for t is served by v2", within=20)
            text_v2 = await ask(api, "t", extra_key="client-key")
            salt_v2 = await expected_salt(table, "t")
            assert {body["extra_key"] for body in bodies(a, b, model=v2["name"])} == {salt_v2}
            assert salt_v2 != salt_v1, "each version has a namespace of its own"
            assert text_v2 == adapter_text(sources[1]) != text_v1, "v2's bytes answer, not v1's"

            async def v1_unloaded() -> bool:
                return not any(v1["name"] in s.adapters for s in (a, b))

            await eventually(v1_unloaded, "the retired v1 is unloaded through /unload_lora_adapter", 20)
            assert [name for s in (a, b) for name in s.unloads] == [v1["name"]]
            assert (a.flushes, b.flushes) == (0, 0), "version-scoped: no cache is ever flushed"


async def test_an_older_sglang_that_already_holds_the_version_refuses_the_reload_and_serves_it(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    """Another kvgate loaded v1 there; older SGLang's /v1/models does not show it, so kvgate asks to load
    it, SGLang refuses the same name, and the refusal's ``loaded_adapters`` (same path) makes it a load."""
    state = SglangStubState(list_adapters=False)
    store, source = tmp_path / "store", make_adapter(b"v1")
    async with stubs(state) as urls:
        v1 = await publish(redis_server, store, "t", source, urls)
        state.adapters[v1["name"]] = v1["path"]
        async with (
            kvgate_serve(redis_server, store, urls, tmp_path / "kvgate.log") as kvgate,
            kvgate.client() as api,
        ):
            assert await ask(api, "t") == adapter_text(source)
            assert await ask(api, "t") == adapter_text(source)
    assert [load["lora_name"] for load in state.loads] == [v1["name"]], "one load asked, and refused"
    assert state.adapters == {v1["name"]: v1["path"]}
    assert len(bodies(state, model=v1["name"])) == 2


async def test_purge_all_flushes_every_sglang_cache_on_a_publish(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    a, b = SglangStubState(), SglangStubState()
    store = tmp_path / "store"
    async with stubs(a, b) as urls:
        v1 = await publish(redis_server, store, "t", make_adapter(b"v1"), urls)
        log = tmp_path / "kvgate.log"
        async with (
            kvgate_serve(redis_server, store, urls, log, invalidation="purge-all") as kvgate,
            kvgate.client() as api,
        ):
            await ask(api, "t", extra_key="client-key", cache_salt="client-salt")
            [body] = bodies(a, b, model=v1["name"])
            assert "extra_key" not in body, "purge-all: no namespace at all"
            assert "cache_salt" not in body
            before = (a.flushes, b.flushes)
            await publish(redis_server, store, "t", make_adapter(b"v2"), urls)

            def both_flushed() -> bool:
                return a.flushes > before[0] and b.flushes > before[1]

            await eventually(both_flushed, "/flush_cache called on both replicas after the publish", 20)
            purged = await kvgate.samples("kvgate_prefix_purges_total")
            assert set(purged) == {labels(replica=url, outcome="purged") for url in urls}, purged


async def test_the_base_fingerprint_probe_keeps_an_sglang_replica_of_another_base_apart(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    a, b = SglangStubState(), SglangStubState(weights=1)  # b: other weights under the same base name
    store = tmp_path / "store"
    async with stubs(a, b) as urls:
        v1 = await publish(redis_server, store, "t", make_adapter(b"v1"), urls[:1])
        async with (
            kvgate_serve(redis_server, store, urls, tmp_path / "kvgate.log") as kvgate,
            kvgate.client() as api,
        ):

            async def b_is_another_base() -> bool:
                seen = {r["url"]: r for r in (await kvgate.status())["replicas"]}
                return "t" in seen[urls[1]]["base_mismatch"]

            await eventually(b_is_another_base, "kvgate reports b as another base for t", 20)
            for _ in range(6):
                await ask(api, "t")
            assert len(bodies(a, model=v1["name"])) == 6, "every request went to a"
            assert bodies(b, model=v1["name"]) == [], "b never served t"
            assert b.loads == [], "nor loaded it"
            probes = a.probes + b.probes  # kvgate's and kvgate publish's: cold, in SGLang's namespace field
            assert all(p.get("extra_key") and "cache_salt" not in p for p in probes), probes
            assert len({p["extra_key"] for p in probes}) == len(probes), "a fresh namespace per probe run"
            seen = {r["url"]: r for r in (await kvgate.status())["replicas"]}
            assert seen[urls[0]]["base_mismatch"] == {}


async def test_the_canary_catches_an_sglang_replica_serving_other_bytes_under_a_versioned_name(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    good, bad = SglangStubState(), SglangStubState()
    store = tmp_path / "store"
    async with stubs(good, bad) as urls, aiohttp.ClientSession() as http:
        v1 = await publish(redis_server, store, "t", make_adapter(b"v1"), urls)
        load = {"lora_name": v1["name"], "lora_path": v1["path"]}
        path = Path(v1["path"])  # the bad one loads other bytes from the very store path, then put back
        saved = swap_bytes(path, make_adapter(b"other bytes"))
        try:
            async with http.post(f"{urls[1]}/load_lora_adapter", json=load) as response:
                assert response.status == 200
        finally:
            swap_back(path, saved)
        async with http.post(f"{urls[0]}/load_lora_adapter", json=load) as response:
            assert response.status == 200  # the good one, from the right bytes
        assert good.contents[v1["name"]] != bad.contents[v1["name"]]
        log = tmp_path / "kvgate.log"
        async with (
            kvgate_serve(redis_server, store, urls, log, canary_interval=0.3) as kvgate,
            kvgate.client() as api,
        ):
            await ask(api, "t")  # the ID is active

            async def caught() -> bool:
                verdicts = await kvgate.samples("kvgate_audit_verdicts_total")
                return labels(logical_id="t", replica=urls[1], verdict="replica-mismatch") in verdicts

            await eventually(caught, "the canary says replica-mismatch for the bad replica", within=30)

            async def repaired() -> bool:
                return v1["name"] not in bad.adapters and (await kvgate.status())["quarantined"] == []

            await eventually(repaired, "the bad copy is unloaded and out of quarantine", within=20)
            quarantines = await kvgate.samples("kvgate_quarantines_total")
            verdicts = await kvgate.samples("kvgate_audit_verdicts_total")
            last = (await kvgate.status())["audits"]["t"]
    assert quarantines == {labels(replica=urls[1], reason="canary: replica-mismatch"): 1.0}, quarantines
    assert bad.unloads == [v1["name"]]
    assert good.unloads == []
    assert v1["name"] in good.adapters
    assert {dict(key)["verdict"] for key in verdicts if dict(key)["replica"] == urls[0]} == {"coherent"}
    assert last[urls[0]]["verdict"] == "coherent"


# --- generic ---------------------------------------------------------------------------------------------


def generic_bodies(*states: StubState, model: str) -> list[dict[str, Any]]:
    return [b for s in states for b in s.received if b.get("model") == model and b.get("prompt") == PROMPT]


async def test_generic_serves_only_what_a_replica_was_started_with_and_warns_of_it(
    redis: Redis, redis_server: EmbeddedRedis, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    a, b = StubState(), StubState()
    store, log = tmp_path / "store", tmp_path / "kvgate.log"
    async with running(build_stub(a)) as url_a, running(build_stub(b)) as url_b:
        urls = [url_a, url_b]
        v1 = await publish(redis_server, store, "t", make_adapter(b"v1"), urls, backend="generic")
        a.adapters[v1["name"]] = v1["path"]  # a was started with v1; b with nothing of t
        async with (
            kvgate_serve(redis_server, store, urls, log, backend="generic") as kvgate,
            kvgate.client() as api,
        ):
            started = log.read_text()
            assert "generic replicas cannot load adapters at runtime" in started
            assert "generic replicas have no cache namespace" in started
            for _ in range(4):
                await ask(api, "t", extra_key="client-key", cache_salt="client-salt")
            served = generic_bodies(a, model=v1["name"])
            assert len(served) == 4, "every request went to the replica that lists v1"
            assert generic_bodies(b, model=v1["name"]) == []
            assert not any({"cache_salt", "extra_key"} & set(body) for body in served), "no namespace at all"

            v2 = await publish(redis_server, store, "t", make_adapter(b"v2"), urls, backend="generic")

            async def v2_not_served_yet() -> bool:
                try:
                    await ask(api, "t")
                except openai.APIStatusError as exc:
                    return (
                        exc.status_code == 503
                        and f"fixed at start on generic backends; start the server with t from {v2['path']}"
                        in exc.message
                    )  # the name a client knows
                return False

            await eventually(v2_not_served_yet, "v2 gets 503 saying why while no replica lists it", 20)
            b.adapters[v2["name"]] = v2["path"]  # b restarted with v2

            async def served_by_v2() -> bool:
                try:
                    await ask(api, "t")
                except openai.APIStatusError:
                    return False
                return bool(generic_bodies(b, model=v2["name"]))

            await eventually(served_by_v2, "v2 served once a replica lists it", 20)
    assert (a.loads, b.loads) == ([], []), "never asked to load"
    assert (a.unloads, a.adapters) == ([], {v1["name"]: v1["path"]}), "never asked to unload the retired v1"
    assert (a.resets, b.resets) == (0, 0)


async def test_generic_refuses_purge_all_at_start(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with running(build_stub(StubState())) as url:
        command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(free_port()), "--replica", url,
                   "--backend", "generic", "--invalidation", "purge-all", "--redis-url", redis_server.url,
                   "--store", str(tmp_path / "store")]  # fmt: skip
        process = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(process.communicate(), timeout=30)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 1
    assert 'invalidation = "purge-all" needs replicas that can purge their prefix cache' in err.decode()
