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


class LoadFailed(Exception):
    """The backend refused or failed a load/unload/purge; ``reason`` is its own words."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class BackendDialect(Protocol):
    name: str
    runtime_loading: bool
    """False for servers whose adapters are fixed at start: kvgate then only routes to listed versions."""
    cache_namespaces: bool
    """True when requests can carry a cache namespace (``set_cache_namespace`` does something)."""

    async def list_adapters(self, session: aiohttp.ClientSession, url: str) -> AdapterListing: ...

    async def load(self, session: aiohttp.ClientSession, url: str, name: str, path: str) -> None: ...

    async def unload(self, session: aiohttp.ClientSession, url: str, name: str) -> None: ...

    async def purge_prefix_cache(self, session: aiohttp.ClientSession, url: str) -> bool:
        """Drop every prefix-cache block on the replica; False when it refused for now (retry later)."""
        ...

    def set_cache_namespace(self, body: dict[str, Any], salt: str) -> None:
        """Put the gateway's cache namespace into a request body (the client's was already removed)."""
        ...
