"""A plain OpenAI-compatible server whose adapters are fixed at start (TGI-style, or anything else).

kvgate can only route to the versions such a server lists in ``/v1/models``: it cannot load, unload,
purge or name a cache namespace there. Safety then rests on versioned names alone, so a server must be
restarted (with the new versioned names) for a new version to be served.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from gateway.core.errors import LoadFailed
from gateway.fleet.backends.base import AdapterListing, fetch_model_list

log = logging.getLogger(__name__)


class GenericOpenAIDialect:
    name = "generic"
    runtime_loading = False
    cache_namespaces = False

    async def list_adapters(self, session: aiohttp.ClientSession, url: str) -> AdapterListing:
        return await fetch_model_list(session, url)

    async def load(self, session: aiohttp.ClientSession, url: str, name: str, path: str) -> None:
        raise LoadFailed(
            f"adapters are fixed at start on generic backends; start the server with {name} from {path}"
        )

    async def unload(self, session: aiohttp.ClientSession, url: str, name: str) -> None:
        log.info("not unloading %s from %s: adapters are fixed at start on generic backends", name, url)

    async def purge_prefix_cache(self, session: aiohttp.ClientSession, url: str) -> bool:
        raise LoadFailed("purging the prefix cache is not supported on generic backends")

    def set_cache_namespace(self, body: dict[str, Any], salt: str) -> None:
        """Nothing: a generic server has no cache namespace (``cache_namespaces`` is False)."""
