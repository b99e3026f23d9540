"""``kvgate agent``: the sidecar beside one vLLM replica that puts verified versions on its local volume.

Routes (every one but ``/healthz`` needs ``Authorization: Bearer <agent_token>``):

- ``POST /v1/fetch`` ``{"digest": "<64 hex>"}``: 200 ``{"digest", "path"}`` once ``<agent_dir>/<digest>/``
  holds exactly that version's bytes (``agent.fetch``), as the replica sees it (``agent_root``);
  503 ``{"error": {"code": <outcome>}}`` when they could not be fetched and verified (changed, truncated
  or missing objects, the object store unreachable, a full disk, no room in the budget);
- ``GET /v1/status``: the verified digests here, the budget and the outcomes counted since start;
- ``GET /healthz``: 200 once the leftovers of a stopped agent are removed.

The agent has no background task: it fetches when asked and reads its replica's listing (parsed by
``fleet.backends.answers``) only when it needs room. It refuses to start without a token.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.adapters.objclient import Client, is_object_url, open_client
from gateway.agent.fetch import Fetcher, FetchFailed
from gateway.core.errors import BadRequest, InvalidAdapter, KvgateError, Unauthorized
from gateway.core.identity import check_digest
from gateway.fleet.backends.base import fetch_model_list

log = logging.getLogger(__name__)
FETCHER = web.AppKey("fetcher", Fetcher)


def build_agent(
    store_url: str,
    agent_dir: Path,
    *,
    token: str,
    replica_url: str,
    agent_root: str,
    disk_bytes: int,
    client: Client | None = None,
    hold_s: float = 300.0,
) -> web.Application:
    if not token:
        raise BadRequest("kvgate agent needs agent_token (KVGATE_AGENT_TOKEN): its fetches are authenticated")
    if not is_object_url(store_url):
        raise BadRequest(f"kvgate agent fetches from an object store (s3://BUCKET/PREFIX), not {store_url!r}")
    session_box: dict[str, aiohttp.ClientSession] = {}

    async def loaded() -> set[str]:
        listing = await fetch_model_list(session_box["session"], replica_url.rstrip("/"))
        return {root.rstrip("/").rpartition("/")[2] for root in listing.adapters.values()}

    fetcher = Fetcher(
        open_client(store_url) if client is None else client,
        agent_dir,
        budget_bytes=disk_bytes,
        loaded=loaded,
        hold_s=hold_s,
    )
    app = web.Application(middlewares=[_errors(token)])
    app[FETCHER] = fetcher
    root = agent_root.rstrip("/")

    async def fetch(request: web.Request) -> web.Response:
        try:
            doc = await request.json()
        except ValueError:
            raise BadRequest("the body is not JSON") from None
        digest = doc.get("digest") if isinstance(doc, dict) else None
        try:
            check_digest(digest if isinstance(digest, str) else "")
        except InvalidAdapter:
            raise BadRequest(
                "digest must be 64 hex digits (a blake3 tree digest)", code="bad-digest"
            ) from None
        assert isinstance(digest, str)
        try:
            await fetcher.ensure(digest)
        except FetchFailed as exc:
            return _error(503, "service_unavailable", exc.detail, exc.outcome)
        return web.json_response({"digest": digest, "path": f"{root}/{digest}"})

    async def status(_: web.Request) -> web.Response:
        here = fetcher.local()
        return web.json_response(
            {
                "root": root,
                "budget_bytes": disk_bytes,
                "used_bytes": sum(here.values()),
                "digests": sorted(here),
                "counts": fetcher.counts,
            }
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        fetcher.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            session_box["session"] = session
            yield

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/fetch", fetch)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/healthz", healthz)
    return app


def _error(status: int, kind: str, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status
    )


def _errors(token: str) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/healthz":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, Unauthorized.type, "a valid agent token is needed", "unauthorized")
        try:
            return await handler(request)
        except KvgateError as exc:
            return _error(exc.status, exc.type, exc.message, str(exc.code or exc.status))

    return middleware
