"""The SGLang and generic dialects against stub servers that follow each server's documented API."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from gateway.fleet.backends import (
    DIALECTS,
    GenericOpenAIDialect,
    LoadFailed,
    SglangDialect,
    VllmDialect,
    dialect_for,
)
from gateway.process.http_edge import free_port, running
from tests.support.stub_backend import StubState, build_stub
from tests.support.stub_sglang import SglangStubState, run_sglang_stub

NAME = "tenant-42@0123456789abcdef"
PATH = "/store/ab/0123456789abcdef"


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


def canned(answers: dict[str, tuple[int, Any]]) -> web.Application:
    """A server answering each path with a fixed (status, JSON or text body)."""

    async def answer(request: web.Request) -> web.Response:
        status, body = answers[request.path]
        if isinstance(body, str):
            return web.Response(text=body, status=status)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    return app


# --- choosing a dialect --------------------------------------------------------------------------------


def test_dialect_for_every_name() -> None:
    assert DIALECTS == ("vllm", "sglang", "generic")
    kinds = {"vllm": VllmDialect, "sglang": SglangDialect, "generic": GenericOpenAIDialect}
    for name in DIALECTS:
        dialect = dialect_for(name)
        assert isinstance(dialect, kinds[name])
        assert dialect.name == name
    assert dialect_for("sglang") is not dialect_for("sglang")  # each replica pool gets its own memory
    assert (dialect_for("sglang").runtime_loading, dialect_for("sglang").cache_namespaces) == (True, True)
    assert (dialect_for("generic").runtime_loading, dialect_for("generic").cache_namespaces) == (False, False)


def test_dialect_for_unknown_name() -> None:
    with pytest.raises(ValueError, match="tgi"):
        dialect_for("tgi")


# --- SGLang ----------------------------------------------------------------------------------------------


async def test_sglang_lists_base_and_loaded_adapters(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(base="qwen", base_root="qwen")
    dialect = SglangDialect()
    async with run_sglang_stub(state) as url:
        assert (await dialect.list_adapters(session, url)).adapters == {}
        await dialect.load(session, url, NAME, PATH)
        listing = await dialect.list_adapters(session, url)
    assert (listing.base_name, listing.base_root, listing.adapters) == ("qwen", "qwen", {NAME: PATH})
    assert state.loads == [{"lora_name": NAME, "lora_path": PATH, "pinned": False}]


async def test_sglang_trusts_a_listing_that_carries_adapters(session: aiohttp.ClientSession) -> None:
    state = SglangStubState()
    dialect = SglangDialect()
    async with run_sglang_stub(state) as url:
        await dialect.load(session, url, NAME, PATH)
        assert NAME in (await dialect.list_adapters(session, url)).adapters
        state.adapters.clear()  # unloaded by someone else: the listing, not the memory, is the truth
        assert (await dialect.list_adapters(session, url)).adapters == {}


async def test_sglang_lists_from_load_answers_when_models_lists_base_only(
    session: aiohttp.ClientSession,
) -> None:
    other = "tenant-42@fedcba9876543210"
    states = [SglangStubState(list_adapters=False), SglangStubState(list_adapters=False)]
    dialect = SglangDialect()
    async with run_sglang_stub(states[0]) as a, run_sglang_stub(states[1]) as b:
        await dialect.load(session, a, NAME, PATH)
        await dialect.load(session, a, other, "/store/fe/dcba9876543210")
        assert (await dialect.list_adapters(session, a)).adapters == {
            NAME: PATH,
            other: "/store/fe/dcba9876543210",
        }
        assert (await dialect.list_adapters(session, b)).adapters == {}  # remembered per URL
        assert (await SglangDialect().list_adapters(session, a)).adapters == {}  # and per instance
        await dialect.unload(session, a, other)
        listing = await dialect.list_adapters(session, a)
    assert (listing.base_name, listing.adapters) == ("base", {NAME: PATH})


async def test_sglang_forgets_a_replica_it_cannot_reach(session: aiohttp.ClientSession) -> None:
    port = free_port()
    dialect = SglangDialect()
    async with run_sglang_stub(SglangStubState(list_adapters=False), port) as url:
        await dialect.load(session, url, NAME, PATH)
        assert NAME in (await dialect.list_adapters(session, url)).adapters
    with pytest.raises(aiohttp.ClientConnectionError):
        await dialect.list_adapters(session, url)
    async with run_sglang_stub(SglangStubState(list_adapters=False), port) as url:  # restarted, empty
        assert (await dialect.list_adapters(session, url)).adapters == {}


async def test_sglang_already_loaded_from_the_same_path_is_success(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(list_adapters=False, adapters={NAME: PATH})  # another kvgate loaded it
    dialect = SglangDialect()
    async with run_sglang_stub(state) as url:
        await dialect.load(session, url, NAME, PATH)
        listing = await dialect.list_adapters(session, url)
    assert len(state.loads) == 1  # SGLang refused the reload; the refusal's loaded_adapters matched
    assert listing.adapters == {NAME: PATH}


async def test_sglang_already_loaded_from_another_path_fails(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(adapters={NAME: "/elsewhere"})
    async with run_sglang_stub(state) as url:
        with pytest.raises(LoadFailed, match="already loaded") as failed:
            await SglangDialect().load(session, url, NAME, PATH)
    assert failed.value.backend_status == 400
    assert state.adapters == {NAME: "/elsewhere"}


async def test_sglang_load_failure_carries_sglang_reason(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(fail_loads="Can't find adapter_config.json")
    async with run_sglang_stub(state) as url:
        with pytest.raises(LoadFailed, match=r"adapter_config\.json") as failed:
            await SglangDialect().load(session, url, NAME, PATH)
    assert failed.value.backend_status == 400


async def test_sglang_reads_loaded_adapters_given_as_lora_refs(session: aiohttp.ClientSession) -> None:
    ref = {"lora_id": "5f2c", "lora_name": NAME, "lora_path": PATH, "pinned": False}
    answers: dict[str, tuple[int, Any]] = {
        "/v1/models": (200, {"object": "list", "data": [{"id": "base", "root": "base", "parent": None}]}),
        "/load_lora_adapter": (200, {"success": True, "error_message": "", "loaded_adapters": {NAME: ref}}),
    }
    dialect = SglangDialect()
    async with running(canned(answers)) as url:
        await dialect.load(session, url, NAME, PATH)
        assert (await dialect.list_adapters(session, url)).adapters == {NAME: PATH}


async def test_sglang_unload(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(adapters={NAME: PATH})
    async with run_sglang_stub(state) as url:
        await SglangDialect().unload(session, url, NAME)
        assert state.adapters == {}
        await SglangDialect().unload(session, url, NAME)  # already gone: nothing to do


async def test_sglang_unload_failure_raises(session: aiohttp.ClientSession) -> None:
    async with running(canned({"/unload_lora_adapter": (500, "Internal Server Error")})) as url:
        with pytest.raises(LoadFailed, match="Internal Server Error") as failed:
            await SglangDialect().unload(session, url, NAME)
    assert failed.value.backend_status == 500


async def test_sglang_purge(session: aiohttp.ClientSession) -> None:
    state = SglangStubState()
    dialect = SglangDialect()
    async with run_sglang_stub(state) as url:
        assert await dialect.purge_prefix_cache(session, url) is True
        state.busy = True
        assert await dialect.purge_prefix_cache(session, url) is False  # retry later
    assert state.flushes == 1


async def test_sglang_purge_failure_raises(session: aiohttp.ClientSession) -> None:
    async with running(canned({"/flush_cache": (503, "Service Unavailable")})) as url:
        with pytest.raises(LoadFailed, match="Service Unavailable") as failed:
            await SglangDialect().purge_prefix_cache(session, url)
    assert failed.value.backend_status == 503


async def test_sglang_namespace_is_extra_key(session: aiohttp.ClientSession) -> None:
    state = SglangStubState(adapters={NAME: PATH})
    body: dict[str, Any] = {"model": NAME, "prompt": "hi", "cache_salt": "client", "extra_key": "client"}
    SglangDialect().set_cache_namespace(body, "kvg-salt")
    async with run_sglang_stub(state) as url, session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
    assert state.received == [{"model": NAME, "prompt": "hi", "extra_key": "kvg-salt"}]


# --- generic OpenAI-compatible ---------------------------------------------------------------------------


async def test_generic_lists_adapters_fixed_at_start(session: aiohttp.ClientSession) -> None:
    state = StubState(base="base", base_root="/models/tiny", adapters={NAME: PATH})
    async with running(build_stub(state)) as url:
        listing = await GenericOpenAIDialect().list_adapters(session, url)
    assert (listing.base_name, listing.base_root, listing.adapters) == ("base", "/models/tiny", {NAME: PATH})


async def test_generic_listing_without_roots(session: aiohttp.ClientSession) -> None:
    data = [{"id": "base", "object": "model"}, {"id": NAME, "object": "model", "parent": "base"}]
    async with running(canned({"/v1/models": (200, {"object": "list", "data": data})})) as url:
        listing = await GenericOpenAIDialect().list_adapters(session, url)
    assert (listing.base_name, listing.base_root, listing.adapters) == ("base", "", {NAME: ""})


async def test_generic_refuses_to_load(session: aiohttp.ClientSession) -> None:
    state = StubState()
    async with running(build_stub(state)) as url:
        with pytest.raises(LoadFailed, match="fixed at start") as failed:
            await GenericOpenAIDialect().load(session, url, NAME, PATH)
    assert f"start the server with {NAME} from {PATH}" in failed.value.reason
    assert state.loads == []  # nothing was asked of the server


async def test_generic_unload_only_logs(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    state = StubState(adapters={NAME: PATH})
    caplog.set_level(logging.INFO, logger="gateway.fleet.backends.generic")
    async with running(build_stub(state)) as url:
        await GenericOpenAIDialect().unload(session, url, NAME)
    assert state.adapters == {NAME: PATH}
    assert NAME in caplog.text


async def test_generic_cannot_purge_or_namespace(session: aiohttp.ClientSession) -> None:
    async with running(build_stub(StubState())) as url:
        with pytest.raises(LoadFailed, match="not supported"):
            await GenericOpenAIDialect().purge_prefix_cache(session, url)
    body: dict[str, Any] = {"model": NAME, "prompt": "hi"}
    GenericOpenAIDialect().set_cache_namespace(body, "kvg-salt")
    assert body == {"model": NAME, "prompt": "hi"}
