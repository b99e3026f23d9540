"""The precise prefix index's memory and time, measured: bytes per million blocks held, the cost of
applying vLLM's ``BlockStored`` events, of keying a request and of matching it, and of tokenizing a
prompt in the gateway (the fixture model's tokenizer).

    .venv/bin/python -m loadtest.precise_index --blocks 1000000 --tokenizer .cache/fixture/model

Blocks arrive as vLLM sends them: events of 3 full blocks of 128 tokens (the CPU build's block size),
64-bit block hashes, one namespace per 100 chains (a versioned adapter name and a salt), spread over
``--replicas`` views. Memory is ``tracemalloc``'s count of what the index allocated (kvgate's own
objects: the views' dicts, keys, vLLM's hashes), after a ``gc.collect``.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from pathlib import Path

from gateway.dev import generated_docs
from gateway.kv.events import BlockStored
from gateway.kv.index import PreciseIndex, block_keys
from gateway.kv.prompt_tokens import PromptTokens, Unrendered
from gateway.proof.experiment import long_prompt

BLOCK = 128
PER_EVENT = 3


def events(blocks: int, seed: int) -> list[BlockStored]:
    rng = random.Random(seed)
    made = []
    for chain in range(blocks // PER_EVENT):
        name, salt = f"tenant-{chain // 100}@{chain // 100:016x}", f"kvg-{chain // 100:032x}"
        tokens = tuple(rng.randrange(32000) for _ in range(BLOCK)) * PER_EVENT
        extra = ((name, salt), (name,), (name,))
        hashes = tuple(rng.getrandbits(64) for _ in range(PER_EVENT))
        made.append(BlockStored(hashes, None, tokens, BLOCK, name, extra, "GPU", 0))
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the figures into this doc's generated block")
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    lines: list[str] = []

    def say(line: str) -> None:
        print(line)
        lines.append(f"- {line}")

    batch = events(args.blocks, args.seed)
    urls = [f"http://r{i}:8000" for i in range(args.replicas)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PreciseIndex(args.blocks)
    started = time.perf_counter()
    for i, event in enumerate(batch):
        index.apply(urls[i % len(urls)], [event])
    applied = time.perf_counter() - started
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = len(index)
    say(f"blocks held: {blocks} over {len(urls)} replica views")
    per_block = held / blocks
    say(f"memory: {held / 1e6:.1f} MB: {per_block:.0f} MB per million blocks ({per_block:.0f} B/block)")
    say(f"apply: {applied / len(batch) * 1e6:.1f} us per BlockStored of {PER_EVENT} blocks")

    sample = batch[len(batch) // 2]
    assert sample.lora_name is not None
    assert sample.extra_keys is not None
    salt = sample.extra_keys[0][1] if sample.extra_keys[0] else None
    namespace = (sample.lora_name, str(salt))
    tokens = sample.token_ids + tuple(range(200))
    rounds = 2000
    started = time.perf_counter()
    for _ in range(rounds):
        keys = block_keys(namespace, tokens, BLOCK)
    keyed = (time.perf_counter() - started) / rounds
    started = time.perf_counter()
    for _ in range(rounds):
        matched = [index.matched(keys, url) for url in urls]
    matching = (time.perf_counter() - started) / rounds
    assert max(matched) == PER_EVENT, matched
    say(f"request keys ({len(tokens)} tokens, {len(keys)} blocks): {keyed * 1e6:.1f} us")
    say(f"match over {len(urls)} replicas: {matching * 1e6:.1f} us")
    if args.tokenizer is not None:
        prompt_tokens = PromptTokens.from_path(args.tokenizer)
        for sentences in (15, 150):
            text = long_prompt(sentences)
            started = time.perf_counter()
            for _ in range(200):
                ids = prompt_tokens.completion({"prompt": text})
            took = (time.perf_counter() - started) / 200
            assert not isinstance(ids, Unrendered)
            chat_started = time.perf_counter()
            for _ in range(200):
                prompt_tokens.chat({"messages": [{"role": "user", "content": text}]})
            chat = (time.perf_counter() - chat_started) / 200
            say(
                f"tokenize {len(text)} chars ({len(ids)} tokens): completion {took * 1e6:.0f} us, "
                f"chat {chat * 1e6:.0f} us"
            )
    if args.out is not None:
        generated_docs.write_block(args.out, generated_docs.measured(
            f"The precise index alone (no servers): {args.blocks:,} blocks in BlockStored events of "
            f"{PER_EVENT} blocks over {args.replicas} replica views; memory by tracemalloc.\n\n"
            + "\n".join(lines)
        ))  # fmt: skip


if __name__ == "__main__":
    main()
