"""Positional-array KV event fixtures, re-encoded from frames captured from a real vLLM replica.

Run with the vLLM virtualenv's python (it needs vLLM's own event classes and msgspec):

    .venv-vllm/bin/python scripts/kv_event_fixtures.py tests/support/fixtures/kv_events/map_frames.json \
        tests/support/fixtures/kv_events/array_frames.json

The 0.32 build encodes events as tagged maps (``KVCacheEvent`` is ``tag=True`` without ``array_like``);
earlier builds encoded them as tagged positional arrays. Each captured payload is decoded with vLLM's own
``msgspec`` decoder into vLLM's own ``KVEventBatch``, and each event is re-encoded by a twin class built
from vLLM's class with ``msgspec.defstruct``: the same fields in vLLM's declaration order, the same tag,
``omit_defaults``, and ``array_like=True``. Topic and sequence frames are kept as captured.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

# msgspec and vLLM live only in the vLLM virtualenv: the project's type checker runs without them.
import msgspec  # type: ignore[import-not-found, unused-ignore]
from vllm.distributed.kv_events import (  # type: ignore[import-not-found, unused-ignore]
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


def array_twin(cls: Any) -> Any:
    """vLLM's event class with the same fields, encoded as a tagged positional array."""
    fields = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default) for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(cls.__name__, fields, tag=True, array_like=True, omit_defaults=True)


def main(source: Path, out: Path) -> None:
    twins = {cls: array_twin(cls) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    encode = msgspec.msgpack.Encoder().encode
    converted = []
    for entry in json.loads(source.read_text()):
        topic, seq, payload = (base64.b64decode(f) for f in entry["frames"])
        batch = decode(payload)
        events = [twins[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
        array_payload = encode([batch.ts, events, batch.data_parallel_rank])
        frames = [base64.b64encode(f).decode() for f in (topic, seq, array_payload)]
        converted.append({"note": entry["note"] + " (re-encoded as positional arrays)", "frames": frames})
    out.write_text(json.dumps(converted, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
