"""A replica's odd answer marks that replica, with the reason, and never stops the polling of the others.

Each case is one a hostile tester sent (issue 17): the stub replica (tests/support/stub_backend.py) answers as
vLLM does, except on the routes a test overrides with raw bytes. The pool and the fingerprints are the
real ones; the end-to-end cases run the real kvgate app on a real Redis.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.core.errors import LoadFailed
from gateway.fleet.backends import SglangDialect, VllmDialect
from gateway.fleet.base_bytes import BaseBytes
from gateway.fleet.base_prints import BasePrints
from gateway.fleet.replicas import ReplicaPool
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TOKEN = "test-admin-token"
HTML = (200, "text/html", b"<html><body>502 Bad Gateway (restarting)</body></html>")
DEEP = b'{"data": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
NOT_UTF8 = b'{"error": {"message": "bad \xff\xfe name"}}'


@dataclass
class Hostile:
    """A stub replica whose answers on some paths are replaced by raw (status, content type, body)."""

    state: StubState = field(default_factory=StubState)
    answers: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)
    url: str = ""

    def app(self) -> web.Application:
        @web.middleware
        async def override(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            answer = self.answers.get(request.path)
            if answer is None:
                if request.path == "/metrics":  # vLLM's exposition, with the stub's start time
                    return web.Response(text=f"process_start_time_seconds {self.state.started}\n")
                return await handler(request)
            status, content_type, body = answer
            return web.Response(status=status, body=body, headers={"Content-Type": content_type})

        app = build_stub(self.state)
        app.middlewares.append(override)
        return app


@contextlib.asynccontextmanager
async def fleet(count: int) -> AsyncIterator[tuple[list[Hostile], ReplicaPool, BasePrints]]:
    replicas = [Hostile() for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        for replica in replicas:
            replica.url = await stack.enter_async_context(running(replica.app()))
        session = await stack.enter_async_context(aiohttp.ClientSession())
        pool = ReplicaPool([r.url for r in replicas], VllmDialect(), session, base_with_root=False)
        prints = BasePrints(pool, floor=0.0, model_dirs={}, bytes_=BaseBytes(None))
        prints.retry_unprintable = 0.0  # every check may probe again (the default waits 30 s)
        yield replicas, pool, prints


async def poll(pool: ReplicaPool, prints: BasePrints) -> None:
    """One poll step as ``ReplicaPool.poll_forever`` runs it: list every replica, then fingerprint."""
    await pool.refresh_all()
    await prints.check_all()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (DEEP, "nested too deep"),
        (b"<html>restarting</html>", "not JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'[{"id": "base"}]', "is a list, not an object"),
        (b'{"data": {"id": "base"}}', "'data' is an object, not a list"),
        (b'{"data": [{"id": 5}]}', "has an 'id' that is a number"),
        (
            b'{"data": [{"id": "base"}, {"id": "a@1", "parent": "base", "root": ["x"]}]}',
            "'root' that is a list",
        ),
    ],
)
async def test_a_malformed_listing_marks_that_replica_unhealthy_with_the_reason(
    answer: bytes, reason: str
) -> None:
    async with fleet(2) as ([bad, good], pool, prints):
        bad.answers["/v1/models"] = (200, "application/json", answer)
        await poll(pool, prints)
        assert not pool.replicas[0].healthy
        assert reason in pool.replicas[0].unhealthy_reason
        assert pool.replicas[1].healthy
        assert pool.replicas[1].base_print is not None
        listings = good.state.listings
        await poll(pool, prints)  # the next poll still reaches the other replica
        assert good.state.listings > listings
        del bad.answers["/v1/models"]  # it answers well again: taken back, fingerprinted
        await poll(pool, prints)
        assert pool.replicas[0].healthy
        assert pool.replicas[0].unhealthy_reason == ""
        assert pool.replicas[0].base_print is not None


@pytest.mark.parametrize("value", [b"1.7e9.1", b"NaN", b"+Inf", b"--"])
async def test_a_start_time_that_is_no_number_leaves_that_replica_without_a_print_until_it_is_one(
    value: bytes,
) -> None:
    async with fleet(2) as ([bad, _], pool, prints):
        bad.answers["/metrics"] = (200, "text/plain", b"# HELP\nprocess_start_time_seconds " + value + b"\n")
        await poll(pool, prints)
        first = pool.replicas[0]
        assert first.healthy
        assert first.base_print is None
        assert "process_start_time_seconds" in first.prints.unprintable
        assert pool.replicas[1].base_print is not None
        probes = bad.state.probes
        await poll(pool, prints)
        assert bad.state.probes == probes, "no print is taken while restarts cannot be seen"
        del bad.answers["/metrics"]
        await poll(pool, prints)
        assert first.base_print is not None
        assert first.prints.unprintable == ""
        assert first.prints.start_time == bad.state.started


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (HTML, "not JSON"),
        ((200, "application/json", b'{"choices": [{"text": 5}]}'), "no list of 8 choice objects"),
        (
            (
                200,
                "application/json",
                b'{"choices": ['
                + b",".join(
                    b'{"index": %d, "logprobs": {"top_logprobs": [{"a": "x"}]}}' % i for i in range(8)
                )
                + b"]}",
            ),
            "top logprob is a string",
        ),
        ((200, "application/json", b'{"choices": {}}'), "no list of 8"),
        ((200, "application/json", DEEP), "nested too deep"),
    ],
)
async def test_a_malformed_probe_answer_after_a_restart_is_retaken_when_it_answers_well(
    answer: tuple[int, str, bytes], reason: str
) -> None:
    async with fleet(2) as ([bad, _], pool, prints):
        await poll(pool, prints)
        first = pool.replicas[0]
        assert first.base_print is not None
        bad.state.started += 100  # it restarted, and answers the probe with a proxy's error page
        bad.answers["/v1/completions"] = answer
        await poll(pool, prints)
        assert first.base_print is None
        assert reason in first.prints.unprintable
        assert pool.replicas[1].base_print is not None
        del bad.answers["/v1/completions"]
        await poll(pool, prints)
        assert first.base_print is not None, "the fingerprint is retaken once the probe answers"


async def test_an_unprintable_replica_waits_before_it_is_probed_again() -> None:
    async with fleet(1) as ([bad], pool, prints):
        prints.retry_unprintable = 3600.0
        bad.answers["/v1/completions"] = HTML
        await poll(pool, prints)
        probes = bad.state.probes
        del bad.answers["/v1/completions"]
        await poll(pool, prints)
        assert bad.state.probes == probes
        assert pool.replicas[0].base_print is None


@pytest.mark.parametrize("dialect", [VllmDialect(), SglangDialect()], ids=["vllm", "sglang"])
@pytest.mark.parametrize("status", [200, 400, 500])
async def test_an_unload_answer_that_is_not_utf8_is_a_refusal_in_its_own_words(
    dialect: Any, status: int
) -> None:
    replica = Hostile()
    path = "/v1/unload_lora_adapter" if isinstance(dialect, VllmDialect) else "/unload_lora_adapter"
    replica.answers[path] = (status, "application/json", b"\xff\xfe not utf-8 \x80")
    async with running(replica.app()) as url, aiohttp.ClientSession() as session:
        if status == 200:
            await dialect.unload(session, url, "a@1")  # a 200 is an unload, whatever its body
            return
        with pytest.raises(LoadFailed) as refused:
            await dialect.unload(session, url, "a@1")
        assert "not utf-8" in refused.value.reason


async def test_kvgate_serves_with_a_bad_start_time_present_at_start_and_polls_the_others(
    redis: Redis, store: AdapterStore
) -> None:
    """``kvgate serve``'s startup (``refresh_all``, ``check_all``) must not fail on one replica's answer;
    the poll loop then goes on reaching the other replica, and status says what is wrong with which."""
    bad, good = Hostile(), Hostile()
    bad.answers["/metrics"] = (200, "text/plain", b"process_start_time_seconds not-a-number\n")
    async with running(bad.app()) as bad.url, running(good.app()) as good.url:
        settings = Settings(replicas=[bad.url, good.url], store=store.root, admin_token=TOKEN,
                            poll_interval=0.05, reconcile_interval=0.1)  # fmt: skip
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:

            async def status() -> dict[str, dict[str, Any]]:
                headers = {"x-kvgate-admin-token": TOKEN}
                async with http.get(f"{url}/kvgate/status", headers=headers) as response:
                    return {r["url"]: r for r in (await response.json())["replicas"]}

            assert "process_start_time_seconds" in (await status())[bad.url]["base_unprintable"]
            bad.answers["/v1/models"] = (200, "application/json", DEEP)
            listings = good.state.listings
            await eventually(lambda: good.state.listings > listings + 3, "the good replica polled on", 10)

            async def bad_is_marked() -> bool:
                seen = (await status())[bad.url]
                return not seen["healthy"] and "nested too deep" in (seen["unhealthy_reason"] or "")

            await eventually(bad_is_marked, "the bad replica marked with the reason", 10)
            bad.answers.clear()

            async def bad_is_back() -> bool:
                seen = (await status())[bad.url]
                return bool(seen["healthy"]) and seen["base_print"] is not None

            await eventually(bad_is_back, "the replica taken back and fingerprinted", 10)


async def test_an_emptied_listing_is_a_restart_only_where_no_start_time_can_say() -> None:
    """A listing that lost every adapter was often emptied by unloads (kvgate's budget, a peer's sweep):
    where ``/metrics`` has a start time, that says whether the replica restarted; elsewhere the empty
    listing is the only sign there is."""
    async with fleet(2) as ([timed, untimed], pool, prints):
        untimed.answers["/metrics"] = (200, "text/plain", b"# a server without a start time\n")
        for replica in (timed, untimed):
            replica.state.adapters["a@1"] = "/store/a1"
        await poll(pool, prints)
        before = [replica.incarnation for replica in pool.replicas]
        for replica in (timed, untimed):
            replica.state.adapters.clear()  # unloaded, no restart
        await poll(pool, prints)
        assert [replica.incarnation for replica in pool.replicas] == [before[0], before[1] + 1]
        assert pool.replicas[1].restart_reason == "its listing lost every adapter"
        timed.state.started += 100  # now it did restart
        await poll(pool, prints)
        assert pool.replicas[0].incarnation == before[0] + 1
        assert pool.replicas[0].restart_reason == "its process start time changed"
