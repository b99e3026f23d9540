"""What kvgate needs from an inference server, as a Protocol each dialect implements."""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp

from gateway.fleet.backends import answers
from gateway.fleet.backends.answers import AdapterListing

__all__ = ["AdapterListing", "BackendDialect", "fetch_model_list"]


async def fetch_model_list(session: aiohttp.ClientSession, url: str) -> AdapterListing:
    """``GET {url}/v1/models``, parsed by ``answers.model_list``; raises on a non-2xx answer, and
    ``MalformedAnswer`` on one kvgate cannot read."""
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        body = await response.read()
    return answers.model_list(answers.json_of(body))


class BackendDialect(Protocol):
    name: str
    runtime_loading: bool
    """False for servers whose adapters are fixed at start: kvgate then only routes to listed versions."""
    cache_namespaces: bool
    """True when requests can carry a cache namespace (``set_cache_namespace`` does something)."""
    prefix_purge: bool
    """True when ``purge_prefix_cache`` can purge (the ``purge-all`` invalidation strategy needs it)."""

    async def list_adapters(self, session: aiohttp.ClientSession, url: str) -> AdapterListing: ...

    async def load(self, session: aiohttp.ClientSession, url: str, name: str, path: str) -> None: ...

    async def unload(self, session: aiohttp.ClientSession, url: str, name: str) -> None: ...

    async def purge_prefix_cache(self, session: aiohttp.ClientSession, url: str) -> bool:
        """Drop every prefix-cache block on the replica; False when it refused for now (retry later)."""
        ...

    def set_cache_namespace(self, body: dict[str, Any], salt: str) -> None:
        """Put the gateway's cache namespace into a request body (the client's was already removed)."""
        ...
