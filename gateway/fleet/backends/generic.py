"""A plain OpenAI-compatible server whose adapters are fixed at start (TGI-style, or anything else).

Choose it only for a server kvgate has no dialect for, knowing what is lost:

- No loading: kvgate routes a version only to replicas whose ``/v1/models`` lists its versioned name
  (``kvgate publish`` prints the name and the path to start the server with). A new version is served
  once a replica was restarted with it; until then its requests get 503. Nothing is ever unloaded.
- No cache namespace: requests carry none (a client's ``cache_salt``/``extra_key`` are still dropped).
  Versions stay apart by their versioned names alone, so the server's prefix cache must key blocks by
  adapter name; an epoch bump (``kvgate bump``) changes nothing on the wire, so it cannot invalidate a
  cache; with API keys on, base-model callers of every tenant share one prefix cache.
- No purge: ``invalidation = "purge-all"`` is refused at start.

``kvgate serve`` logs these limits as warnings at start (``start_warnings``).
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
    prefix_purge = False

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
