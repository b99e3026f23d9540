"""Version-scoped prefix block keys, and which replica served which blocks.

A prompt (for chat, the canonical JSON of its messages) is cut into fixed-size character blocks; block
keys chain blake3 hashes seeded by the request's cache namespace, which already covers the table
generation, base identity, adapter digest and epoch. So a key can only ever match requests of the same
effective model and epoch: after an update or a bump, old entries never match again (they age out).
The index is a bounded LRU of block key -> replicas that computed it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from blake3 import blake3

BLOCK_CHARS = 256
MAX_BLOCKS = 256  # bounds the hashing work per request (64 KiB of prompt)
KEY_BYTES = 16


def prompt_text(body: dict[str, Any]) -> str:
    """What the prefix cache sees first: the prompt, or the chat messages in a canonical rendering."""
    if "messages" in body:
        return json.dumps(body["messages"], separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


def block_keys(seed: str, text: str) -> list[bytes]:
    """Chained keys of every full block: key[i] depends on the seed and on blocks 0..i."""
    keys: list[bytes] = []
    previous = blake3(seed.encode()).digest()[:KEY_BYTES]
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        chunk = text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS].encode()
        previous = blake3(previous + chunk).digest()[:KEY_BYTES]
        keys.append(previous)
    return keys


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def matched(self, keys: list[bytes], replica: str) -> int:
        """How many leading blocks ``replica`` is known to hold."""
        count = 0
        for key in keys:
            holders = self._entries.get(key)
            if holders is None or replica not in holders:
                break
            count += 1
        return count

    def record(self, keys: list[bytes], replica: str) -> None:
        entries = self._entries
        for key in keys:
            holders = entries.get(key)
            if holders is None:
                entries[key] = {replica}
            else:
                holders.add(replica)
                entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
