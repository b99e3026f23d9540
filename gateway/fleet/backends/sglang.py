"""SGLang: the runtime LoRA API (``/load_lora_adapter``), the ``extra_key`` namespace and ``/flush_cache``.

Listing. ``/v1/models`` always lists the base; newer SGLang also lists each loaded adapter (``parent`` set,
``root`` = its path), older SGLang does not. The answer to every load and unload carries
``loaded_adapters`` (name -> path), so each dialect instance remembers the last one per replica URL and
lists from that memory while the replica's ``/v1/models`` has never carried an adapter. Once it has, the
listing alone is trusted. The memory is dropped when the replica cannot be reached (a restarted SGLang
has lost what it had loaded); a load that SGLang then refuses as "already loaded" refills it.

Loading. SGLang refuses to load a name it already has, and kvgate never reloads a name: a new version
always loads under a new versioned name from its content-addressed path. A refusal therefore counts as
success only when the refusal's ``loaded_adapters`` shows that name loaded from that same path (another
kvgate won the race); any other refusal is a ``LoadFailed``.

Cache namespace. SGLang keys radix-cache entries by ``extra_key``; on the OpenAI endpoints it builds that
key as ``cache_salt + extra_key``. kvgate writes its salt into ``extra_key`` and drops ``cache_salt``, so
the key is exactly the salt whatever the client sent: the proxy strips only a client's ``cache_salt``,
and ``extra_key`` is also the field SGLang's native ``/generate`` accepts, where ``cache_salt`` does not
exist.

Purge. ``/flush_cache`` answers 200 when it flushed, 400 while requests are running or waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.core.errors import LoadFailed, MalformedAnswer
from gateway.fleet.backends import answers
from gateway.fleet.backends.base import AdapterListing, fetch_model_list

_ALREADY_LOADED = ("already loaded", "already exists")
_GONE = ("does not exist", "not found", "not loaded")
_BUSY = ("busy", "running or waiting requests", "not idle")


class SglangDialect:
    name = "sglang"
    runtime_loading = True
    cache_namespaces = True
    prefix_purge = True

    def __init__(self) -> None:
        self._loaded: dict[str, dict[str, str]] = {}  # URL -> loaded_adapters of its last load/unload answer
        self._listing_has_adapters: set[str] = set()  # URLs whose /v1/models has listed an adapter

    async def list_adapters(self, session: aiohttp.ClientSession, url: str) -> AdapterListing:
        try:
            listing = await fetch_model_list(session, url)
        except aiohttp.ClientConnectionError:
            self._loaded.pop(url, None)
            raise
        if listing.adapters:
            self._listing_has_adapters.add(url)
        if url in self._listing_has_adapters:
            return listing
        return AdapterListing(listing.base_name, listing.base_root, dict(self._loaded.get(url, {})))

    async def load(self, session: aiohttp.ClientSession, url: str, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path, "pinned": False}
        async with session.post(f"{url}/load_lora_adapter", json=body) as response:
            answer = await _read_answer(response)
        self._remember(url, answer)
        if answer.success:
            return
        if _mentions(answer.reason, _ALREADY_LOADED) and (answer.loaded or {}).get(name) == path:
            return
        raise LoadFailed(answer.reason, answer.status)

    async def unload(self, session: aiohttp.ClientSession, url: str, name: str) -> None:
        async with session.post(f"{url}/unload_lora_adapter", json={"lora_name": name}) as response:
            answer = await _read_answer(response)
        self._remember(url, answer)
        if not (answer.success or answer.status == 404 or _mentions(answer.reason, _GONE)):
            raise LoadFailed(answer.reason, answer.status)
        self._loaded.get(url, {}).pop(name, None)

    async def purge_prefix_cache(self, session: aiohttp.ClientSession, url: str) -> bool:
        """``POST /flush_cache``; False while SGLang has running or waiting requests (it then answers 400)."""
        async with session.post(f"{url}/flush_cache") as response:
            if response.status == 200:
                return True
            status, text = response.status, answers.reason_of(await response.read(), response.status)
        if _mentions(text, _BUSY):
            return False
        raise LoadFailed(text, status)

    def set_cache_namespace(self, body: dict[str, Any], salt: str) -> None:
        body.pop("cache_salt", None)
        body["extra_key"] = salt

    def _remember(self, url: str, answer: _Answer) -> None:
        if answer.loaded is not None:
            self._loaded[url] = answer.loaded


@dataclass(frozen=True, slots=True)
class _Answer:
    """SGLang's ``{success, error_message, loaded_adapters}``, or what stood in for it."""

    status: int
    success: bool
    reason: str
    loaded: dict[str, str] | None


async def _read_answer(response: aiohttp.ClientResponse) -> _Answer:
    body = await response.read()
    try:
        data = answers.json_of(body)
    except MalformedAnswer:
        data = None
    fallback = answers.reason_of(body, response.status)
    if not isinstance(data, dict):
        return _Answer(response.status, response.status == 200, fallback, None)
    success = response.status == 200 and data.get("success", True) is not False
    return _Answer(response.status, success, _reason(data) or fallback, _loaded_adapters(data))


def _reason(data: dict[str, Any]) -> str:
    """SGLang's ``error_message``, FastAPI's ``message``/``detail``, or OpenAI's ``error.message``."""
    error = data.get("error")
    for value in (
        data.get("error_message"),
        data.get("message"),
        data.get("detail"),
        error.get("message") if isinstance(error, dict) else error,
    ):
        if value:
            return str(value)
    return ""


def _loaded_adapters(data: dict[str, Any]) -> dict[str, str] | None:
    """``loaded_adapters`` as name -> path; SGLang versions send the path or a ``LoRARef`` object."""
    loaded = data.get("loaded_adapters")
    if not isinstance(loaded, dict):
        return None
    adapters: dict[str, str] = {}
    for name, ref in loaded.items():
        path = ref.get("lora_path") if isinstance(ref, dict) else ref
        if isinstance(path, str):
            adapters[str(name)] = path
    return adapters


def _mentions(text: str, markers: tuple[str, ...]) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in markers)
