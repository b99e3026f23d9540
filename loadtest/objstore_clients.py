"""Which S3 client the object store uses: ``obstore`` against ``boto3``, measured side by side.

One moto S3 server process (the one the tests use; it is Python, so it is the bottleneck of every figure
here: they compare clients against the same server, not against a real S3), one 200 MB object, ROUNDS
rounds, each client in turn within a round: upload (multipart, 8 MiB parts, 4 at a time) and download
to a file. Then kvgate's own paths over obstore: ``ObjectStore.ingest`` (blake3 of the file, the
upload, the conditional copy into place) and the agent's fetch (download, per-file and tree blake3,
rename). Medians of ROUNDS. The dependency weight is what each client installs: the package and every
package it requires, recursively, as installed here (files counted from their metadata).

    .venv/bin/python -m loadtest.objstore_clients --rounds 3 --out docs/object-store.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata as md
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import obstore

from gateway.adapters.objstore import PART_BYTES, ObjectStore, open_client
from gateway.agent.fetch import Fetcher
from gateway.core.identity import scan_adapter, tree_digest
from gateway.dev import generated_docs
from tests.support.s3_server import environment, s3_server

MB = 1 << 20


def closure(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for requirement in dist.requires or []:
            if "extra ==" in requirement:
                continue
            todo.append(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
    return seen


def weight(name: str) -> tuple[int, float]:
    names = closure(name)
    total = 0
    for each in names:
        for file in md.distribution(each).files or []:
            path = Path(str(file.locate()))
            if path.is_file():
                total += path.stat().st_size
    return len(names), total / MB


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    generated_docs.started_tree()
    import boto3
    from boto3.s3.transfer import TransferConfig

    work = Path(tempfile.mkdtemp(prefix="objstore-bench-"))
    blob = work / "adapter" / "adapter_model.safetensors"
    blob.parent.mkdir()
    blob.write_bytes(os.urandom(args.mb * MB))
    (blob.parent / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}'
    )
    times: dict[str, list[float]] = {}
    with s3_server(work / "moto.log") as server, environment(server.environment()):
        bucket = server.new_bucket()
        s3 = boto3.client("s3", endpoint_url=server.endpoint)
        transfer = TransferConfig(
            multipart_chunksize=PART_BYTES, multipart_threshold=PART_BYTES, max_concurrency=4
        )
        client = open_client(f"s3://{bucket}")
        for i in range(args.rounds):
            for label, run in _rounds(s3, transfer, client, bucket, blob, work, i).items():
                times.setdefault(label, []).append(timed(run))
    lines = [
        f"{args.mb} MB, medians of {args.rounds} rounds (each round: every row once, in this order).",
        "",
        "| client, operation | median s | MB/s | every round (s) |",
        "| --- | ---: | ---: | --- |",
    ]
    for label, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {label} | {median:.2f} | {args.mb / median:.0f} | "
                     f"{', '.join(f'{v:.2f}' for v in values)} |")  # fmt: skip
    lines += [
        "",
        "| client | packages installed (itself and what it requires) | MB on disk |",
        "| --- | ---: | ---: |",
    ]
    for name in ("obstore", "boto3"):
        count, size = weight(name)
        lines.append(f"| {name} | {count} | {size:.1f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        generated_docs.write_block(args.out, generated_docs.measured(report))
    sys.exit(0)


def _rounds(
    s3: Any, transfer: Any, client: obstore.store.S3Store, bucket: str, blob: Path, work: Path, i: int
) -> dict[str, Callable[[], object]]:
    """Round I's runs, in order."""
    store = f"s3://{bucket}/store{i}"

    def fetch() -> None:
        digest = tree_digest(blob.parent, scan_adapter(blob.parent))  # milliseconds beside the fetch
        fetcher = Fetcher(
            open_client(store), work / f"agent{i}", budget_bytes=1 << 40, loaded=_nothing_loaded
        )
        fetcher.start()
        asyncio.run(fetcher.ensure(digest))

    return {
        "boto3 upload": lambda: s3.upload_file(str(blob), bucket, f"b{i}", Config=transfer),
        "boto3 download": lambda: s3.download_file(bucket, f"b{i}", str(work / "out"), Config=transfer),
        "obstore upload": lambda: obstore.put(
            client, f"o{i}", blob, use_multipart=True, chunk_size=PART_BYTES, max_concurrency=4
        ),
        "obstore download": lambda: _download(client, f"o{i}", work / "out"),
        "kvgate publish (ObjectStore.ingest)": lambda: ObjectStore(store, max_bytes=1 << 40).ingest(
            blob.parent
        ),
        "kvgate agent fetch (download + verify + rename)": fetch,
    }


def _download(client: obstore.store.S3Store, key: str, target: Path) -> None:
    with open(target, "wb") as out:
        for chunk in obstore.get(client, key).stream(min_chunk_size=8 * MB):
            out.write(chunk)


async def _nothing_loaded() -> set[str]:
    return set()


if __name__ == "__main__":
    main()
