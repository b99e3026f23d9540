"""vLLM (0.32, unmodified): the runtime LoRA API and ``cache_salt``.

Loads always use a new versioned name and the content-addressed root, never ``load_inplace``:
vLLM keys prefix-cache blocks by (lora name, lora path), not by bytes, so an in-place reload from the
same path would keep matching blocks computed with the old weights.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.core.errors import LoadFailed, MalformedAnswer
from gateway.fleet.backends import answers
from gateway.fleet.backends.base import AdapterListing, fetch_model_list

_ALREADY_LOADED = "has already been loaded"


class VllmDialect:
    name = "vllm"
    runtime_loading = True
    cache_namespaces = True
    prefix_purge = True

    async def list_adapters(self, session: aiohttp.ClientSession, url: str) -> AdapterListing:
        return await fetch_model_list(session, url)

    async def load(self, session: aiohttp.ClientSession, url: str, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": False}
        async with session.post(f"{url}/v1/load_lora_adapter", json=body) as response:
            if response.status == 200:
                return
            reason = await _reason(response)
            if response.status == 400 and _ALREADY_LOADED in reason:
                return  # another kvgate won the race; eligibility still checks the listed root
            raise LoadFailed(reason, response.status)

    async def unload(self, session: aiohttp.ClientSession, url: str, name: str) -> None:
        async with session.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}) as response:
            if response.status not in (200, 404):
                raise LoadFailed(await _reason(response), response.status)

    async def purge_prefix_cache(self, session: aiohttp.ClientSession, url: str) -> bool:
        """``POST /reset_prefix_cache`` (needs ``VLLM_SERVER_DEV_MODE=1``); False while blocks are in use."""
        async with session.post(f"{url}/reset_prefix_cache") as response:
            if response.status != 200:
                raise LoadFailed(await _reason(response), response.status)
            body = await response.read()
        try:
            doc = answers.json_of(body)
        except MalformedAnswer:
            return True  # a 200 is the purge; only ``{"success": false}`` says it waits for blocks in use
        return not (isinstance(doc, dict) and doc.get("success") is False)

    def set_cache_namespace(self, body: dict[str, Any], salt: str) -> None:
        body["cache_salt"] = salt


async def _reason(response: aiohttp.ClientResponse) -> str:
    return answers.reason_of(await response.read(), response.status)
