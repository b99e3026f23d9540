"""The KV-event path planned past this machine: 100 replicas x 20,000 blocks, 16 workers per node, 100
kvgates (issue 29; docs/scale.md).

Measured here with kvgate's real code on synthetic events (map-encoded ``BlockStored`` as vLLM 0.32
sends them, 16-token blocks, one namespace per chain, spread over ``--replicas`` replicas):

- **cost per block**: what the KV indexer runs per batch, ``kv.events.decode_message(native=True)`` and
  ``kv.index.PreciseIndex.apply_batch`` (the C path, ``kv._native``) with the shared table as its mirror
  (``kv.shared_index.SharedWriter``), over ``--sample`` blocks, the median of ``--repeats`` batches;
  beside it the Python path (``decode_payload`` and ``apply``: what every worker ran before, and what a
  batch past the plain case still takes);
- **memory per block**: the indexer's views (``tracemalloc``: vLLM's hash to kvgate's key, the holds)
  and the shared table's bytes per slot for ``--replicas`` replicas;
- **read cost per request**: ``SharedReader.held_blocks`` for a request of 8 blocks, every replica asked.

Then the model (arithmetic on those figures, for the fleet the flags describe), for the old design (every
worker follows every replica) and this one (one KV indexer per kvgate): events decoded per second per
node, the cores that takes, index memory per node, Redis commands for KV events, and the time from a
replica's event to every kvgate's view, at a realistic and a peak rate of blocks stored per replica.

    .venv/bin/python -m loadtest.kv_fleet_model [--out docs/scale.md]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import msgpack

from gateway.dev import generated_docs
from gateway.kv.events import decode_message
from gateway.kv.index import PreciseIndex
from gateway.kv.shared_index import Layout, SharedReader, SharedRegion, SharedWriter, create

BLOCK = 16
PER_EVENT = 4  # blocks a BlockStored carries (a request's new blocks in one engine step)
BATCH_S = 0.05  # vLLM publishes a batch per engine step: about every 50 ms under load
REPORT_S = 0.2  # the indexer's record interval (kv.indexer.REPORT_S): routing trust moves this late


def synthetic(replica: int, blocks: int, rng: random.Random) -> bytes:
    """One batch of ``blocks`` blocks for one replica, map-encoded, unique hashes."""
    events = []
    for chain in range(blocks // PER_EVENT):
        name = f"tenant-{chain % 50}@{chain % 50:016x}"
        events.append({
            "type": "BlockStored", "block_hashes": [rng.getrandbits(63) for _ in range(PER_EVENT)],
            "parent_block_hash": None, "token_ids": [rng.randrange(32000) for _ in range(PER_EVENT * BLOCK)],
            "block_size": BLOCK, "lora_id": 1, "medium": "GPU", "lora_name": name,
            "extra_keys": [[name, f"kvg-{chain % 50:032x}"]] + [[name]] * (PER_EVENT - 1), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        })  # fmt: skip
    payload: bytes = msgpack.packb([time.time(), events, 0])
    return payload


def measure(args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    urls = [f"http://replica-{i}:8000" for i in range(args.replicas)]
    fd = create(args.sample * 2, urls)
    writer = SharedWriter(SharedRegion(fd, urls))
    writer.start(1)
    reader = SharedReader(SharedRegion(fd, urls))
    per_batch = args.sample // args.repeats
    batches = [(i % args.replicas, synthetic(i, per_batch, rng)) for i in range(args.repeats)]
    index = PreciseIndex(args.sample * 2, mirror=writer)
    timed: dict[str, list[float]] = {"decode_us": [], "apply_us": [], "py_decode_us": [], "py_apply_us": []}
    for replica, payload in batches:  # timed (no tracemalloc: it slows every allocation)
        url = urls[replica]
        for path in ("", "py_"):  # the C path, then the Python path on the same batch, emptied between
            began = time.perf_counter()
            batch = decode_message([b"kv", bytes(8), payload], native=not path)
            assert (batch.native is None) == bool(path), "a plain batch is read in C, when asked"
            decoded = time.perf_counter()
            index.apply_batch(url, batch, 0)  # Python's path: PreciseIndex.apply on the events
            applied = time.perf_counter()
            timed[f"{path}decode_us"].append((decoded - began) / per_batch * 1e6)
            timed[f"{path}apply_us"].append((applied - decoded) / per_batch * 1e6)
            index.clear(url)
    held = per_batch * len(batches)
    for url in urls:
        index.clear(url)
    gc.collect()
    tracemalloc.start()
    counted = PreciseIndex(args.sample * 2)  # the same views, counted (not mirrored: the table is apart)
    for replica, payload in batches:
        counted.apply_batch(urls[replica], decode_message([b"kv", bytes(8), payload], native=True), 0)
    del payload
    gc.collect()
    view_bytes = tracemalloc.get_traced_memory()[0] / len(counted)
    tracemalloc.stop()
    for url in urls:
        index.clear(url)
    for replica, payload in batches:
        index.apply_batch(urls[replica], decode_message([b"kv", bytes(8), payload], native=True), 0)
    for url in urls:
        writer.report(url, "following", {}, 0.0, index.blocks(url), None, 0)
    tokens = list(range(8 * BLOCK))
    reads = []
    for _ in range(200):
        began = time.perf_counter()
        ask = reader.held_blocks(("tenant-1@0000000000000001", "kvg-1"), tokens)
        for url in urls:
            ask(url)
        reads.append((time.perf_counter() - began) * 1e6)
    layout = Layout.sized(1, args.replicas)
    writer.close()
    reader.region.close()
    os.close(fd)
    return {
        **{name: statistics.median(values) for name, values in timed.items()},
        "view_bytes": view_bytes,
        "slot_bytes": 8 + 8 * layout.words,
        "read_us": statistics.median(reads),
        "held": held,
    }


def render(m: dict[str, float], args: argparse.Namespace) -> str:
    per_block_us = m["decode_us"] + m["apply_us"]
    core_rate = 1e6 / per_block_us  # blocks/s one core decodes and applies: the indexer's C path
    py_rate = 1e6 / (m["py_decode_us"] + m["py_apply_us"])  # the Python path every worker ran before
    held = args.replicas * args.blocks  # blocks the fleet holds: every kvgate's index holds all of them
    slots = Layout.sized(held, args.replicas).capacity
    table_mb = slots * m["slot_bytes"] / 1e6
    views_mb = held * m["view_bytes"] / 1e6
    lines = [
        f"Measured with kvgate's real code (Python {sys.version.split()[0]}, this machine, "
        f"{len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f} at the end): "
        f"{args.sample:,} synthetic blocks "
        f"({BLOCK}-token, {PER_EVENT} a `BlockStored`, map-encoded) over {args.replicas} replicas, "
        f"median of {args.repeats} batches.",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| C path: parse a block (`decode_message(native=True)`: `kv._native.parse`) | "
        f"{m['decode_us'] * 1000:.0f} ns |",
        "| C path: apply a block to the views and the shared table (`PreciseIndex.apply_batch`: "
        f"`kv._native.View.apply`) | {m['apply_us'] * 1000:.0f} ns |",
        f"| **one core, the C path (the KV indexer's)** | **{core_rate:,.0f} blocks/s** |",
        f"| Python path: decode a block (`decode_payload`) | {m['py_decode_us']:.1f} µs |",
        f"| Python path: apply a block (`PreciseIndex.apply`) | {m['py_apply_us']:.1f} µs |",
        f"| one core, the Python path (every worker before; a batch past the plain case now) | "
        f"{py_rate:,.0f} blocks/s ({core_rate / py_rate:.1f}x fewer) |",
        f"| indexer's views per block held (`tracemalloc`) | {m['view_bytes']:.0f} B |",
        f"| shared table per slot ({args.replicas} replicas: {(m['slot_bytes'] - 8) // 8:.0f} mask words) | "
        f"{m['slot_bytes']:.0f} B |",
        f"| a request's read: 8 blocks, all {args.replicas} replicas asked (`held_blocks`) | "
        f"{m['read_us']:.0f} µs |",
        "",
        f"The fleet: {args.replicas} replicas x {args.blocks:,} blocks ({held:,} blocks, every kvgate's "
        f"index holds all of them), {args.workers} workers per node, {args.kvgates} kvgates (one per node). "
        f"Batches every {BATCH_S * 1000:.0f} ms per replica. KV events never touch Redis in either design "
        "(0 commands; the epoch table's traffic is the section below).",
        "",
        "| per replica | design | blocks decoded/s per node | cores to keep up (this machine) | "
        "index memory per node | fleet-wide decode (all kvgates) | event -> every kvgate's view |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, rate in (("realistic", args.realistic), ("peak", args.peak)):
        fleet_rate = args.replicas * rate  # blocks/s the replicas store, together
        designs = (("every worker follows, in Python (before)", args.workers, py_rate),
                   ("one KV indexer, in C (this)", 1, core_rate))  # fmt: skip
        for design, copies, design_rate in designs:
            decoded = fleet_rate * copies
            cores = decoded / design_rate
            memory = copies * views_mb + (table_mb if copies == 1 else 0)
            per_process = fleet_rate / design_rate  # one follower process's load: >= 1 core never keeps up
            if per_process < 1:
                batch_ms = rate * BATCH_S * 1e3 / design_rate / max(1e-9, 1 - per_process)
                delay = (
                    f"~{BATCH_S * 1000 + batch_ms:.0f} ms (+ {REPORT_S * 1000:.0f} ms for the routing trust)"
                )
            else:
                delay = f"never: {per_process:.1f}x one core: lagging, dropped, predicted"
            lines.append(
                f"| {label}: {rate:,} blocks/s | {design} | {decoded:,.0f} | {cores:.2f} | "
                f"{memory:,.0f} MB | {decoded * args.kvgates:,.0f} | {delay} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=20_000, help="blocks each replica holds")
    parser.add_argument("--workers", type=int, default=16, help="workers per node")
    parser.add_argument("--kvgates", type=int, default=100)
    parser.add_argument("--realistic", type=int, default=500, help="blocks a replica stores per second")
    parser.add_argument("--peak", type=int, default=5_000, help="blocks a replica stores per second at peak")
    parser.add_argument("--sample", type=int, default=200_000, help="synthetic blocks measured")
    parser.add_argument("--repeats", type=int, default=50, help="batches the sample is cut into")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="-", help="markdown doc to write the block into ('-': print only)")
    args = parser.parse_args(argv)
    generated_docs.started_tree()
    body = render(measure(args), args)
    print(body)
    if args.out != "-":
        generated_docs.write_block(Path(args.out), generated_docs.measured(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
