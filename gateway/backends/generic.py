"""A plain OpenAI-compatible server whose adapters are fixed at start (TGI-style, or anything else).

kvgate can only route to the versions such a server lists in ``/v1/models``: it cannot load, unload,
purge or name a cache namespace there. Safety then rests on versioned names alone, so a server must be
restarted (with the new versioned names) for a new version to be served.

Also holds ``parse_model_list``, the OpenAI ``/v1/models`` reading that other dialects share.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from gateway.backends.base import AdapterListing, LoadFailed

log = logging.getLogger(__name__)


def parse_model_list(listing: Any) -> AdapterListing:
    """Read an OpenAI model list: the first entry without ``parent`` is the base, the rest are adapters.

    A missing ``root`` reads as ``""`` (the loader then sees a root that is not in its store).
    """
    base_name: str | None = None
    base_root: str | None = None
    adapters: dict[str, str] = {}
    models = listing.get("data") if isinstance(listing, dict) else None
    for model in models if isinstance(models, list) else []:
        if not isinstance(model, dict) or "id" not in model:
            continue
        if model.get("parent"):
            adapters[str(model["id"])] = str(model.get("root") or "")
        elif base_name is None:
            base_name, base_root = str(model["id"]), str(model.get("root") or "")
    return AdapterListing(base_name, base_root, adapters)


async def fetch_model_list(session: aiohttp.ClientSession, url: str) -> AdapterListing:
    """``GET {url}/v1/models``, parsed by ``parse_model_list``; raises on a non-2xx answer."""
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        return parse_model_list(await response.json(content_type=None))


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
