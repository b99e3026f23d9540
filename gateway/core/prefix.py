"""Version-scoped prefix block keys, and which replica served which blocks.

A prompt (for chat, the canonical JSON of its messages) is cut into fixed-size character blocks; a
block's key is a digest of the prompt up to that block's end (``content_keys``) led by a tag of the
request's cache namespace (``block_keys``), which already covers the table generation, base identity,
adapter digest and epoch. So a key can only ever match requests of the same effective model and epoch:
after an update or a bump, old entries never match again (they age out). The digests, the costly part
(0.4 ms for 256 blocks), are computed where a large body is parsed (``body.bounded``, off the serving
loop); the tag is one hash per request.
The index is a bounded LRU of block key -> replicas that computed it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from blake3 import blake3

BLOCK_CHARS = 256
MAX_BLOCKS = 256  # bounds the hashing work per request (64 KiB of prompt)
PREFIX_CHARS = BLOCK_CHARS * MAX_BLOCKS  # the most of a prompt any key covers
KEY_BYTES = 16  # a block's content digest
TAG_BYTES = 8  # the cache namespace's tag leading each key
_RUN = 256  # list items rendered by one json.dumps call when they are all scalars
_SHORT = 1024  # strings up to this length join a run of scalars
_SCALARS = (int, float, bool, type(None))


def prompt_text(body: dict[str, Any], limit: int = PREFIX_CHARS) -> str:
    """What the prefix cache sees first: the prompt, or the chat messages in a canonical rendering
    (compact JSON, sorted keys, non-ASCII as it is), cut to its first ``limit`` characters.

    Only that much is rendered: a 4 MB prompt costs about what a 64 KiB one does, and the rendering is
    iterative, so nesting depth costs no recursion. It equals the first ``limit`` characters of
    ``json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)``.
    """
    if "messages" in body:
        value = body["messages"]
    else:
        value = body.get("prompt", "")
        if isinstance(value, str):
            return value[:limit]
    pieces: list[str] = []
    size = 0
    for piece in _render(value, limit):
        pieces.append(piece)
        size += len(piece)
        if size >= limit:
            break
    return "".join(pieces)[:limit]


class _Text(str):
    """Rendered JSON text, as opposed to a string value still to render."""

    __slots__ = ()


_OPEN_LIST, _CLOSE_LIST, _OPEN_DICT, _CLOSE_DICT, _COMMA = map(_Text, "[]{},")
_END = object()


def _render(value: object, limit: int) -> Iterator[str]:
    """Pieces of the canonical rendering, in order; a stack of iterators instead of recursion."""
    stack: list[Iterator[object]] = [iter((value,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, _Text):
            yield item
        elif isinstance(item, str):
            yield _string(item, limit)
        elif isinstance(item, list):
            stack.append(_list_items(item, limit))
        elif isinstance(item, dict):
            stack.append(_dict_items(item, limit))
        else:
            yield json.dumps(item)


def _list_items(items: list[Any], limit: int) -> Iterator[object]:
    # Every item renders to at least one character: no more than ``limit`` of them can show.
    yield _OPEN_LIST
    shown = items[:limit] if len(items) > limit else items
    for start in range(0, len(shown), _RUN):
        run = shown[start : start + _RUN]
        if start:
            yield _COMMA
        if all(type(x) in _SCALARS or (type(x) is str and len(x) <= _SHORT) for x in run):
            yield _Text(json.dumps(run, separators=(",", ":"), ensure_ascii=False)[1:-1])
            continue
        for index, item in enumerate(run):
            if index:
                yield _COMMA
            yield item
    yield _CLOSE_LIST


def _dict_items(members: dict[str, Any], limit: int) -> Iterator[object]:
    yield _OPEN_DICT
    for index, key in enumerate(sorted(members)):
        if index:
            yield _COMMA
        yield _Text(_string(key, limit) + ":")
        yield members[key]
    yield _CLOSE_DICT


def _string(text: str, limit: int) -> str:
    """A JSON string; a long one only as far as ``limit`` characters can show (escapes only lengthen)."""
    return json.dumps(text[:limit] if len(text) > limit else text, ensure_ascii=False)


def content_keys(text: str) -> list[bytes]:
    """A digest per full block of ``text`` (at most ``MAX_BLOCKS``): the i-th covers blocks 0 to i and
    nothing else. One running hash, read after each block (BLAKE3 reads its state without ending it)."""
    hasher = blake3()
    keys: list[bytes] = []
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        hasher.update(text[i * BLOCK_CHARS : (i + 1) * BLOCK_CHARS].encode())
        keys.append(hasher.digest(KEY_BYTES))
    return keys


def block_keys(seed: str, content: Sequence[bytes]) -> list[bytes]:
    """A prompt's keys in the cache namespace ``seed``: its ``content_keys``, each led by the namespace's
    tag, so key[i] depends on the seed and on blocks 0..i (another namespace never matches)."""
    tag = blake3(seed.encode()).digest(TAG_BYTES)
    return [tag + key for key in content]


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
