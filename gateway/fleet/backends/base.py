"""What kvgate needs from an inference server, as a Protocol each dialect implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp


@dataclass(frozen=True, slots=True)
class AdapterListing:
    """One replica's answer to "what do you serve?"."""

    base_name: str | None
    base_root: str | None
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> root path it was loaded from
    max_model_len: int | None = None  # the base's context length, when the server reports it (vLLM does)


def parse_model_list(listing: Any) -> AdapterListing:
    """Read an OpenAI model list: the first entry without ``parent`` is the base, the rest are adapters.

    A missing ``root`` reads as ``""`` (the loader then sees a root that is not in its store).
    """
    base_name: str | None = None
    base_root: str | None = None
    max_model_len: int | None = None
    adapters: dict[str, str] = {}
    models = listing.get("data") if isinstance(listing, dict) else None
    for model in models if isinstance(models, list) else []:
        if not isinstance(model, dict) or "id" not in model:
            continue
        if model.get("parent"):
            adapters[str(model["id"])] = str(model.get("root") or "")
        elif base_name is None:
            base_name, base_root = str(model["id"]), str(model.get("root") or "")
            context = model.get("max_model_len")
            max_model_len = context if isinstance(context, int) and context > 0 else None
    return AdapterListing(base_name, base_root, adapters, max_model_len)


async def fetch_model_list(session: aiohttp.ClientSession, url: str) -> AdapterListing:
    """``GET {url}/v1/models``, parsed by ``parse_model_list``; raises on a non-2xx answer."""
    async with session.get(f"{url}/v1/models") as response:
        response.raise_for_status()
        return parse_model_list(await response.json(content_type=None))


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
