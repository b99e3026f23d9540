"""Prefix routing on real vLLM CPU replicas through 2 kvgates x 2 workers: predicted vs precise.

Two real vLLM CPU replicas publish their KV cache events (``--kv-events-config``) and have a KV cache
smaller than the working set (``--num-gpu-blocks-override``). Tenants with system prompts of several
128-token blocks, Zipf-popular, hold multi-turn conversations: turn k's prompt is the system prompt, the
earlier turns and a new question, sent once turn k-1 answered. Every request goes through one of two
``kvgate serve --workers 2`` processes on one Redis (four processes, each with its own predicted index),
alternating between the kvgates, on a new connection each time (so each kvgate's kernel hands it to either
worker, as it would distinct clients). One tenant gets two new versions mid-run (``kvgate publish``), so
blocks of its old versions sit on the replicas while the new one serves. Runs, each from the same clean
state (replica caches reset, adapters unloaded, Redis flushed, the tenants' versions loaded on both
replicas, the same seeded conversations):

- ``predicted``: kvgate's own index of where it sent prompts (``--no-kv-events``);
- ``precise``: ``--kv-events --tokenizer <the fixture model>`` (passed explicitly, whatever the defaults);
- ``load-only`` (only when asked, ``--modes``): prefix routing off (``prefix_index_entries 0``).

The benchmark follows both replicas' event streams itself (``kv.events`` + ``kv.index``): for
each request it computes, at the moment it is sent, the blocks the best replica holds of its prompt in its
namespace (an oracle that knows every replica's blocks at decision time, capped at what vLLM can reuse: not
the prompt's last token); and afterwards it checks every cache hit against the blocks of the request's own
version (versioned ``lora_name`` and salt) its replica ever stored: a hit larger than those would have
counted another version's blocks.

    .venv/bin/python -m loadtest.prefix_real --vllm-python .venv-vllm/bin/python \\
        --fixture-dir .cache/fixture --out docs/prefix_routing.md --plot docs/prefix_routing_real.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from redis.asyncio import Redis

from gateway.core.errors import MalformedEvent
from gateway.core.wire import (
    ADMIN_TOKEN_HEADER,
    PIN_HEADER,
    PREFIX_MATCH_HEADER,
    REPLICA_HEADER,
    VERSION_HEADER,
)
from gateway.dev import generated_docs
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, start_replicas
from gateway.kv.events import BlockRemoved, BlockStored, decode_message
from gateway.kv.index import Namespace, PreciseIndex, block_keys, stored_namespace
from gateway.kv.prompt_tokens import PromptTokens
from gateway.process.http_edge import free_port
from gateway.proof.experiment import long_prompt
from gateway.table.redis_server import EmbeddedRedis

log = logging.getLogger("prefix_real")
TOKEN = "loadtest-admin-token"
BLOCK = 128  # vLLM's KV block on the CPU build
FAST = ("--reconcile-interval", "0.2", "--poll-interval", "0.5", "--drain-grace", "0.3")


@dataclass(frozen=True)
class Run:
    mode: str  # load-only | predicted | precise
    kvgates: int
    workers: int

    @property
    def label(self) -> str:
        return f"{self.mode}, {self.kvgates} kvgates x {self.workers} workers"

    def flags(self, tokenizer: Path) -> list[str]:
        if self.mode == "load-only":
            return ["--prefix-index-entries", "0", "--no-kv-events"]
        if self.mode == "predicted":
            return ["--no-kv-events"]
        return ["--kv-events", "--tokenizer", str(tokenizer)]


RUNS = (Run("load-only", 2, 2), Run("predicted", 2, 2), Run("precise", 2, 2))


@dataclass
class Result:
    index: int
    tenant: str
    version: str
    replica: str
    match: str  # the decision's x-kvgate-prefix-match: "precise:3", "predicted:2", "none:0"
    reusable: int  # blocks of the prompt vLLM could reuse (all but the last token's)
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    oracle_blocks: int  # the best replica's blocks of this prompt in the served version's namespace, at send
    chosen_blocks: int = 0  # what the replica kvgate chose held of it then (same namespace, same cap)
    own_blocks: int = 0  # leading blocks of the served namespace its replica ever stored (after the run)
    other_version_blocks: int = 0  # at send: its replica's blocks of the prompt in another version


@dataclass
class Events:
    """Both replicas' KV events, as the oracle sees them: ``live`` (stores and removals) and ``ever``
    (stores only: every block a replica held during the run)."""

    live: PreciseIndex = field(default_factory=lambda: PreciseIndex(10_000_000))
    ever: PreciseIndex = field(default_factory=lambda: PreciseIndex(10_000_000))
    salts: dict[str, set[str | None]] = field(default_factory=dict)  # lora_name -> salts seen
    stored: int = 0
    removed: int = 0
    gaps: int = 0
    malformed: int = 0

    def reset(self) -> None:
        self.live, self.ever, self.salts = PreciseIndex(10_000_000), PreciseIndex(10_000_000), {}
        self.stored = self.removed = self.gaps = self.malformed = 0

    def namespaces(self, name: str) -> list[Namespace]:
        return [(name, salt) for salt in self.salts.get(name, ())]


async def follow(events: Events, replica: VllmProcess, endpoint: str, context: zmq.asyncio.Context) -> None:
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    expected: int | None = None
    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                batch = decode_message(frames)
            except MalformedEvent:
                events.malformed += 1
                continue
            if expected is not None and batch.seq != expected:
                events.gaps += 1
            expected = batch.seq + 1
            events.malformed += batch.malformed
            for event in batch.events:
                if isinstance(event, BlockStored):
                    events.stored += len(event.block_hashes)
                    if event.parent_block_hash is None and (ns := stored_namespace(event)) is not None:
                        events.salts.setdefault(str(ns[0]), set()).add(ns[1])
                    events.ever.apply(replica.url, [event])
                elif isinstance(event, BlockRemoved):
                    events.removed += len(event.block_hashes)
            events.live.apply(replica.url, batch.events)
    finally:
        socket.close()


def kv_events_config(port: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})  # fmt: skip


def system_prompt(tenant: int, sentences: int) -> str:
    return f"System prompt of tenant {tenant}: answer as the tenant's assistant. " + long_prompt(sentences)


@dataclass(frozen=True)
class Planned:
    index: int  # in plan order (the first ``--warmup`` are not counted)
    conversation: int
    turn: int
    tenant: int
    prompt: str


def plan(conversations: int, turns: int, tenants: int, sentences: int, seed: int) -> list[list[Planned]]:
    """Each conversation's turns, in order: turn k's prompt is turn k-1's, its answer (a fixed text: the
    client's history, not the model's words) and a new question."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(tenants)]  # Zipf, s = 1
    systems = [system_prompt(t, sentences) for t in range(tenants)]
    made: list[list[Planned]] = []
    index = 0
    for c in range(conversations):
        tenant = rng.choices(range(tenants), weights)[0]
        prompt, conversation = systems[tenant], []
        for turn in range(rng.randint(1, turns)):
            prompt += f"\nUser ({c}.{turn}, {rng.randrange(10**6)}): {long_prompt(1)}\nAssistant:"
            conversation.append(Planned(index, c, turn, tenant, prompt))
            index += 1
            prompt += " " + long_prompt(3)
        made.append(conversation)
    return made


async def cli(*args: str, redis_url: str, store: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "gateway.cli", *args, "--redis-url", redis_url, "--store", str(store)]
    process = await asyncio.create_subprocess_exec(
        *command, "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"kvgate {' '.join(args)}: {err.decode()[-2000:]}")
    doc: dict[str, Any] = json.loads(out)
    return doc


@contextlib.asynccontextmanager
async def kvgates(
    run: Run, flags: list[str], replicas: list[VllmProcess], redis_url: str, store: Path, logs: Path
) -> AsyncIterator[list[str]]:
    urls, processes = [], []
    env = {**os.environ, "KVGATE_ADMIN_TOKEN": TOKEN}
    try:
        for i in range(run.kvgates):
            port = free_port()
            command = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--redis-url",
                       redis_url, "--store", str(store), *[a for r in replicas for a in ("--replica", r.url)],
                       "--expose-replica-urls", "--max-adapters-per-replica", "8",
                       "--workers", str(run.workers), *FAST, *flags]  # fmt: skip
            log_file = (logs / f"kvgate-{i}.log").open("ab")
            processes.append(await asyncio.create_subprocess_exec(*command, env=env, stderr=log_file))
            urls.append(f"http://127.0.0.1:{port}")
        async with aiohttp.ClientSession() as http:
            for url in urls:
                await until(http, f"{url}/healthz", 60)
        yield urls
    finally:
        for process in processes:
            if process.returncode is None:
                process.terminate()
        for process in processes:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 20)
            if process.returncode is None:
                process.kill()
                await process.wait()


async def until(http: aiohttp.ClientSession, url: str, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer 200 within {within} s")
        await asyncio.sleep(0.3)


async def routing(http: aiohttp.ClientSession, urls: list[str]) -> dict[str, int]:
    """The kvgates' routing decisions, summed from their /metrics (reason, and the prefix match's source)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, int] = {}
    for url in urls:
        async with http.get(f"{url}/metrics", headers={ADMIN_TOKEN_HEADER: TOKEN}) as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvgate_routing_decisions_total":
                    key = s.labels["decision"]
                elif s.name == "kvgate_prefix_matched_blocks_count":
                    key = "matched:" + s.labels["source"]
                else:
                    continue
                counts[key] = counts.get(key, 0) + int(s.value)
    return counts


async def clean_replicas(http: aiohttp.ClientSession, replicas: list[VllmProcess]) -> None:
    """Every adapter unloaded and the prefix cache reset on both replicas (a run starts cold)."""
    for replica in replicas:
        async with http.get(f"{replica.url}/v1/models") as response:
            models = (await response.json())["data"]
        for model in models:
            if model.get("parent"):
                async with http.post(f"{replica.url}/v1/unload_lora_adapter",
                                     json={"lora_name": model["id"]}) as response:  # fmt: skip
                    await response.read()
        for _ in range(100):
            async with http.post(f"{replica.url}/reset_prefix_cache") as response:
                text = await response.text()
            if response.status == 200 and '"success": false' not in text.replace(" ", " "):
                break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError(f"{replica.url} did not reset its prefix cache: {text}")


async def stream(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[dict[str, str], int, int, float]:  # fmt: skip
    """One streamed completion: (evidence headers, prompt tokens, cached tokens, seconds to first token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {await response.text()}")
        evidence = {
            k: response.headers[k]
            for k in (VERSION_HEADER, REPLICA_HEADER, PREFIX_MATCH_HEADER)
            if k in response.headers
        }
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            usage = json.loads(line[6:]).get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return evidence, int(usage.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0), ttft or 0.0


async def run_one(
    run: Run,
    args: argparse.Namespace,
    replicas: list[VllmProcess],
    redis: Redis,
    redis_url: str,
    events: Events,
    tokens: PromptTokens,
    work: Path,
) -> tuple[list[Result], dict[str, int]]:
    store, fixture = work / "store", args.fixture_dir
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        await clean_replicas(http, replicas)
        await redis.flushdb()
        await asyncio.sleep(1.0)  # the reset's events (if any) are in before the oracle starts over
        events.reset()
        names = [f"tenant-{t}" for t in range(args.tenants)]
        versions: dict[str, list[str]] = {}
        published = await asyncio.gather(
            *(cli("publish", n, str(fixture / "adapters" / "v1"), redis_url=redis_url, store=store)
              for n in names)
        )  # fmt: skip
        for name, doc in zip(names, published, strict=True):
            versions[name] = [doc["name"]]
        flags = run.flags(fixture / "model")
        async with kvgates(run, flags, replicas, redis_url, store, work) as urls:
            for name in names:  # every tenant's version on both replicas before traffic
                for replica in replicas:
                    pin = {PIN_HEADER: replica.url, ADMIN_TOKEN_HEADER: TOKEN}
                    await stream(http, urls[0], name, "Hello.", 1, headers=pin)
            await asyncio.sleep(1.5)  # the kvgates' polls see both replicas hold every version
            conversations = plan(args.conversations, args.turns, args.tenants, args.sentences, args.seed)
            planned = [item for conversation in conversations for item in conversation]
            updates = {len(planned) * k // 3: f"v{k + 1}" for k in (1, 2)}
            queue: asyncio.Queue[list[Planned]] = asyncio.Queue()
            for conversation in conversations:
                queue.put_nowait(conversation)
            results: list[Result] = []
            # a new connection a request: each kvgate's kernel hands it to either of its workers
            fresh = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=300)
            )
            background: list[asyncio.Task[None]] = []

            async def publish(version: str) -> None:
                doc = await cli("publish", names[0], str(fixture / "adapters" / version),
                                redis_url=redis_url, store=store)  # fmt: skip
                versions[names[0]].append(doc["name"])

            async def worker() -> None:
                while not queue.empty():
                    for item in queue.get_nowait():
                        await send(item)

            async def send(item: Planned) -> None:
                if item.index in updates:
                    background.append(asyncio.create_task(publish(updates[item.index])))
                name = names[item.tenant]
                ids = tokens.completion({"prompt": item.prompt}) or ()
                reusable = (len(ids) - 1) // BLOCK  # vLLM computes at least the last prompt token
                held: dict[tuple[str, str], int] = {}  # (version, replica) -> blocks held, at send
                for version in versions[name]:
                    for ns in events.namespaces(version):
                        keys = block_keys(ns, ids, BLOCK)
                        for r in replicas:
                            blocks = min(events.live.matched(keys, r.url), reusable)
                            held[version, r.url] = max(held.get((version, r.url), 0), blocks)
                url = urls[random.Random(f"{args.seed}/{item.index}").randrange(len(urls))]
                evidence, prompt_tokens, cached, ttft = await stream(
                    fresh, url, name, item.prompt, args.max_tokens
                )
                served, on = evidence.get(VERSION_HEADER, ""), evidence.get(REPLICA_HEADER, "")
                oracle = max((n for (v, _), n in held.items() if v == served), default=0)
                chosen = held.get((served, on), 0)
                other = max((n for (v, r), n in held.items() if v != served and r == on), default=0)
                match = evidence.get(PREFIX_MATCH_HEADER, "")
                results.append(Result(item.index, name, served, on, match, reusable, prompt_tokens,
                                      cached, ttft, oracle, chosen, other_version_blocks=other))  # fmt: skip

            started = time.monotonic()
            try:
                await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            finally:
                await fresh.close()
            await asyncio.gather(*background)
            took = time.monotonic() - started
            decisions = await routing(http, urls)
        await asyncio.sleep(1.0)  # the last events are in
        for result in results:
            ids = tokens.completion({"prompt": planned[result.index].prompt}) or ()
            for ns in events.namespaces(result.version):
                ever = events.ever.matched(block_keys(ns, ids, BLOCK), result.replica)
                result.own_blocks = max(result.own_blocks, ever)
        print(f"{run.label}: {len(results)} requests in {took:.0f} s; blocks stored {events.stored}, "
              f"removed {events.removed}; event gaps {events.gaps}, malformed {events.malformed}; "
              f"versions of {names[0]}: {', '.join(versions[names[0]])}; kvgate decisions {decisions}",
              flush=True)  # fmt: skip
        results.sort(key=lambda r: r.index)
        dump = work / f"results-{run.mode}-{run.kvgates}.json"
        dump.write_text(json.dumps([vars(r) for r in results], indent=1))
        return results, decisions


@dataclass(frozen=True)
class Row:
    run: Run
    requests: int
    cached_ratio: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    oracle_share: float
    chosen_share: float
    misrouted: int
    oracle_ratio: float
    cross_version_hits: int
    at_risk: int
    per_replica: str
    evicted: int
    decisions: str
    reusable: int  # blocks vLLM could have reused, over the measured requests
    hit_blocks: int
    nobody: int  # reusable blocks no replica held at send (first sight or evicted)
    elsewhere: int  # blocks the best replica held and the chosen one did not, at send
    lost: int  # blocks the chosen replica held at send but did not hit (evicted before prefill)
    later_turns: int  # measured requests that are a conversation's turn 2 or later
    later_turn_ratio: float  # their cached-token ratio
    matches: str  # the decisions' x-kvgate-prefix-match sources


def summarize(
    run: Run,
    results: list[Result],
    warmup: int,
    evicted: int,
    decisions: dict[str, int],
    turns: dict[int, int],
) -> Row:
    measured = [r for r in results if r.index >= warmup]
    prompt = sum(r.prompt_tokens for r in measured)
    cached = sum(r.cached_tokens for r in measured)
    hit_blocks = sum(r.cached_tokens // BLOCK for r in measured)
    oracle_blocks = sum(r.oracle_blocks for r in measured)
    ttfts = sorted(r.ttft_s * 1000 for r in measured)
    replicas = sorted({r.replica for r in results})
    later = [r for r in measured if turns[r.index] > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    sources = Counter(r.match.partition(":")[0] or "missing" for r in measured)
    return Row(
        run,
        len(measured),
        cached / prompt if prompt else 0.0,
        statistics.median(ttfts),
        ttfts[int(0.9 * (len(ttfts) - 1))],
        hit_blocks / oracle_blocks if oracle_blocks else float("nan"),
        sum(r.chosen_blocks for r in measured) / oracle_blocks if oracle_blocks else float("nan"),
        sum(1 for r in measured if r.chosen_blocks < r.oracle_blocks),
        oracle_blocks * BLOCK / prompt if prompt else 0.0,
        sum(1 for r in results if r.cached_tokens // BLOCK > r.own_blocks),
        sum(1 for r in results if r.other_version_blocks > 0),
        " / ".join(str(sum(1 for r in measured if r.replica == url)) for url in replicas),
        evicted,
        ", ".join(f"{k} {v}" for k, v in sorted(decisions.items())),
        sum(r.reusable for r in measured),
        hit_blocks,
        sum(max(r.reusable - r.oracle_blocks, 0) for r in measured),
        sum(max(r.oracle_blocks - r.chosen_blocks, 0) for r in measured),
        sum(max(r.chosen_blocks - r.cached_tokens // BLOCK, 0) for r in measured),
        len(later),
        sum(r.cached_tokens for r in later) / later_prompt if later_prompt else 0.0,
        ", ".join(f"{k} {v}" for k, v in sorted(sources.items())),
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| run | requests | cached-token ratio | later turns' cached-token ratio (requests) | TTFT p50 (ms) "
        "| TTFT p90 (ms) | hit blocks / oracle's | oracle's cached-token ratio "
        "| hits on another version's blocks "
        "| requests with another version's blocks of their prompt on their replica |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.run.label} | {r.requests} | {r.cached_ratio:.1%} | {r.later_turn_ratio:.1%} "
            f"({r.later_turns}) | {r.ttft_p50_ms:.0f} | {r.ttft_p90_ms:.0f} | {r.oracle_share:.1%} | "
            f"{r.oracle_ratio:.1%} | {r.cross_version_hits} | {r.at_risk} |"
        )
    return "\n".join(lines)


def misses(rows: Sequence[Row]) -> str:
    """Where the reusable blocks went: hit, or missed because nobody held them, because the decision went
    elsewhere, or because the chosen replica lost them before the request's prefill."""
    lines = [
        "| run | reusable blocks | hit | held by no replica at send (first sight, evicted) "
        "| held by another replica than the chosen one | held by the chosen one at send, not hit "
        "| decisions' prefix match source |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        whole = r.reusable or 1
        lines.append(
            f"| {r.run.label} | {r.reusable:,} | {r.hit_blocks / whole:.1%} | {r.nobody / whole:.1%} | "
            f"{r.elsewhere / whole:.1%} | {r.lost / whole:.1%} | {r.matches} |"
        )
    return "\n".join(lines)


def diagnostics(rows: Sequence[Row]) -> str:
    lines = [
        "| run | chosen replica's blocks at send / oracle's | requests sent to a replica holding fewer "
        "blocks than the best | requests per replica | blocks evicted | kvgate decisions (from /metrics) |",
        "| --- | ---: | ---: | --- | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.run.label} | {r.chosen_share:.1%} | {r.misrouted} | {r.per_replica} | {r.evicted:,} | "
            f"{r.decisions} |"
        )
    return "\n".join(lines)


def verdicts(rows: Sequence[Row]) -> str:
    by = {r.run.mode: r for r in rows}
    out = []
    precise, predicted = by.get("precise"), by.get("predicted")
    if precise and predicted:
        gain = (precise.cached_ratio - predicted.cached_ratio) * 100
        times = precise.cached_ratio / predicted.cached_ratio if predicted.cached_ratio else float("nan")
        out.append(
            f"- precise against predicted ({precise.run.label.partition(', ')[2]}): cached-token ratio "
            f"{precise.cached_ratio:.1%} vs {predicted.cached_ratio:.1%} ({gain:+.1f} points, {times:.2f}x); "
            f"later turns {precise.later_turn_ratio:.1%} vs {predicted.later_turn_ratio:.1%}; hit blocks "
            f"{precise.oracle_share:.1%} vs {predicted.oracle_share:.1%} of the oracle's"
        )
    crossed = sum(r.cross_version_hits for r in rows)
    risk = sum(r.at_risk for r in rows)
    verdict = "**met**" if crossed == 0 else "**missed**"
    out.append(f"- {crossed} requests counted a prefix hit for blocks of another version (over all runs; "
               f"{risk} requests had another version's blocks of their prompt on their replica): "
               f"{verdict}")  # fmt: skip
    return "\n".join(out)


def plot(rows: Sequence[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r.run.label.replace(", ", "\n") for r in rows]
    left.bar(labels, [r.cached_ratio * 100 for r in rows], color="tab:blue", label="measured")
    left.plot(labels, [r.oracle_ratio * 100 for r in rows], "k_", markersize=30, label="oracle at send")
    left.set_ylabel("cached-token ratio (%)")
    left.legend(fontsize=8)
    right.bar(labels, [r.ttft_p50_ms for r in rows], color="tab:green", label="p50")
    right.plot(labels, [r.ttft_p90_ms for r in rows], "r_", markersize=30, label="p90")
    right.set_ylabel("TTFT (ms)")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    figure.suptitle("Prefix routing on 2 real vLLM CPU replicas (cache smaller than the working set)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvgate-prefix-real-"))
    ports = [(free_port(), free_port()) for _ in (0, 1)]
    specs = [
        VllmReplicaSpec(
            args.vllm_python, args.fixture_dir / "model", free_port(), work / f"vllm-{i}.log",
            max_loras=8, max_cpu_loras=12,
            extra_args=("--kv-events-config", kv_events_config(*ports[i]),
                        "--num-gpu-blocks-override", str(args.kv_blocks)),
        )
        for i in (0, 1)
    ]  # fmt: skip
    tokens = PromptTokens.from_path(args.fixture_dir / "model")
    events = Events()
    rows: list[Row] = []
    runs = [r for r in RUNS if r.mode in args.modes]
    conversations = plan(args.conversations, args.turns, args.tenants, args.sentences, args.seed)
    planned = [item for conversation in conversations for item in conversation]
    turns = {item.index: item.turn for item in planned}
    with EmbeddedRedis(work) as redis_server:
        redis = Redis.from_url(redis_server.url)
        replicas = await start_replicas(specs)
        context = zmq.asyncio.Context()
        followers = [
            asyncio.create_task(follow(events, r, f"tcp://127.0.0.1:{ports[i][0]}", context))
            for i, r in enumerate(replicas)
        ]
        try:
            await asyncio.sleep(1.0)
            longest = max(len(tokens.completion({"prompt": item.prompt}) or ()) for item in planned)
            print(f"replicas up; {len(planned)} requests, the longest {longest} tokens", flush=True)
            for run in runs:
                results, decisions = await run_one(
                    run, args, replicas, redis, redis_server.url, events, tokens, work
                )
                rows.append(summarize(run, results, args.warmup, events.removed, decisions, turns))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                print(diagnostics(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
            context.destroy(linger=0)
            await asyncio.gather(*(r.stop() for r in replicas))
            await redis.aclose()
    system = len(tokens.completion({"prompt": system_prompt(0, args.sentences)}) or ())
    later = sum(1 for item in planned if item.turn > 0)
    report = (
        f"{len(planned)} requests per run in {len(conversations)} conversations of 1-{args.turns} turns "
        f"({later} later turns; {args.warmup} warm-up requests not counted), {args.concurrency} "
        f"conversations at a time, `max_tokens` {args.max_tokens}; {args.tenants} tenants, Zipf popularity "
        f"(s = 1), each with a system prompt of {system} tokens ({system // BLOCK} full blocks of {BLOCK}); "
        f"a turn adds a question and the previous answer (about one block), the longest prompt "
        f"{longest} tokens; tenant-0 gets v2 after 1/3 and v3 after 2/3 of the requests (`kvgate publish`). "
        f"KV cache: {args.kv_blocks} blocks per replica (`--num-gpu-blocks-override`), against "
        f"{args.tenants * (system // BLOCK)} blocks of system prompts (one version each). Each request goes "
        f"to one of the two kvgates (seeded draw) on a new connection. Seed {args.seed}.\n\n"
        f"{table(rows)}\n\n{verdicts(rows)}\n\n"
        f"Where the reusable blocks went (blocks of 128 tokens vLLM could reuse, all but the last token's; "
        f"at send: by the replicas' own KV events, as the benchmark follows them):\n\n{misses(rows)}\n\n"
        f"Diagnostics (the warm-up excluded, except decisions and evictions: whole runs):\n\n"
        f"{diagnostics(rows)}\n"
    )
    print(report)
    if args.out is not None:
        generated_docs.write_block(args.out, generated_docs.measured(report))
    if args.plot is not None:
        plot(rows, args.plot)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--fixture-dir", type=Path, required=True)
    parser.add_argument("--conversations", type=int, default=80)
    parser.add_argument("--turns", type=int, default=4, help="a conversation has 1 to this many turns")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at a time")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--sentences", type=int, default=12)
    parser.add_argument("--kv-blocks", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["predicted", "precise"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
