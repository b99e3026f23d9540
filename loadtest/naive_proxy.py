"""The naive peer: an aiohttp reverse proxy that forwards the body and streams the response back.

No parsing, no rewriting, no routing: the floor an aiohttp-based gateway starts from.
Run: ``python -m loadtest.naive_proxy --port P --upstream http://127.0.0.1:Q``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)
_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"})


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path_qs
    async with request.app[SESSION].request(request.method, url, data=body, headers=headers) as upstream:
        response = web.StreamResponse(status=upstream.status)
        response.headers.update({k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _session(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        app[SESSION] = session
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
