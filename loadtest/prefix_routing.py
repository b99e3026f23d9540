"""Prefix routing with independent kvgate processes: predicted against precise, at 1, 2, 4 and 8 processes.

A deterministic (seeded) discrete-event **simulation**: no vLLM, no HTTP. What is real is kvgate's code:

- each kvgate process (one worker of ``kvgate serve --workers N``, or one kvgate) has its own
  ``gateway.core.scheduler.Scheduler``, so its own predicted ``PrefixIndex`` (fed as the proxy feeds it:
  ``Scheduler.served`` when the answer completes, on that process only) and its own
  ``gateway.fleet.replicas.Replica`` objects (its own in-flight counts, ``begin``/``end``, which the load
  bound reads);
- **predicted**: ``Scheduler.decide`` with no KV events;
- **precise**: the same, with a ``gateway.kv.index.PreciseIndex`` fed real ``BlockStored`` /
  ``BlockRemoved`` events (``gateway.kv.events``) that the simulated replicas publish when a block enters
  or leaves their cache, delivered ``event_lag_s`` later. Every process follows every replica's stream, so
  every process's view is the same: one index object stands for the N identical ones;
- a request's block keys come from ``gateway.core.prefix.block_keys`` over ``prompt_text`` of its chat
  body, salted per tenant version with ``gateway.core.wire.cache_salt``.

What is simulated: the arrivals, service times, which process a request reaches (uniformly at random, as
``SO_REUSEPORT`` spreads new connections over the workers and a load balancer over kvgates), and each
replica's prefix cache, in kvgate's block units (``BLOCK_CHARS`` characters): a bounded pool that behaves
like vLLM's (a request's cached leading blocks are pinned when it is scheduled, its other blocks become
cached after a short prefill, freed blocks go into an LRU tail first, evicted only while unused). The
replicas publish one synthetic token per block (``block_size`` 1), so the precise index keys the very
blocks the cache holds.

The workload has shared prefixes (tenants' system prompts, Zipf-popular) and many multi-turn
conversations: turn k's prompt is the system prompt, the earlier turns and a new question, so it extends
turn k-1's blocks. Each later turn reaches a process at random, so with N processes a conversation's
history was most often placed by another process.

Every block of every prompt is accounted for: a hit, or a miss with one reason (``REASONS``).

Run from the repository root:

    .venv/bin/python -m loadtest.prefix_routing [--processes 1 2 4 8] [--replicas 4] [--requests N] \\
        [--seed S] [--out docs/prefix_routing.md]
"""

from __future__ import annotations

import argparse
import heapq
import random
import shlex
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from blake3 import blake3

from gateway.core.model import Target, VersionState
from gateway.core.prefix import BLOCK_CHARS, TAG_BYTES, block_keys, content_keys, prompt_text
from gateway.core.scheduler import Scheduler, eligible, least_loaded, within_bound
from gateway.core.wire import cache_salt
from gateway.dev import generated_docs
from gateway.fleet.backends import AdapterListing
from gateway.fleet.replicas import Replica
from gateway.kv.events import BlockRemoved, BlockStored, Event
from gateway.kv.index import PreciseIndex

Policy = Literal["predicted", "precise", "least-loaded"]
PAIRED: tuple[Policy, ...] = ("predicted", "precise")  # side by side at each process count
BASE = "sim-base"
GENERATION = "sim-generation"

# Why a prompt block was not a cache hit, in the order the accounting peels them off.
REASONS = (
    "first sight",  # no replica had ever cached it (a new question, or one a request still prefills)
    "evicted",  # some replica had cached it, none held it any more
    "load bound",  # only replicas above this process's bounded share of in-flight requests held it
    "another process's placement",  # held within the bound, put there by another process: unknown here
    "not yet recorded",  # held within the bound, but its request had not completed: no index had it yet
    "stale guess",  # the index sent it to a replica that had evicted what the index promised
    "events in flight",  # precise: the holder's BlockStored had not reached kvgate yet
    "tie or load",  # the index knew the holder; the decision went elsewhere (tie-break, load)
)

# the heading of the real-vLLM section of docs/prefix_routing.md (loadtest/prefix_real.py's figures)
REAL_ANCHOR = "on-real-vllm-replicas-two-kvgates-with-two-workers-each-predicted-vs-precise"
_COMPLETE, _PREFILLED, _EVENT, _ARRIVE = 0, 1, 2, 3  # at equal times: free, cache, publish, schedule


@dataclass(frozen=True, slots=True)
class Config:
    processes: tuple[int, ...] = (1, 2, 4, 8)
    replicas: int = 4
    requests: int = 20_000
    seed: int = 1
    tenants: int = 32
    zipf: float = 1.0
    system_blocks: tuple[int, int] = (4, 16)
    turns: tuple[int, int] = (1, 8)
    question_blocks: tuple[int, int] = (0, 1)
    answer_blocks: tuple[int, int] = (1, 2)
    think_s: float = 10.0
    cache_blocks: tuple[int, ...] = (600, 1500)  # per replica; one set of runs for each
    concurrency_per_replica: float = 4.0
    mean_service_s: float = 1.0
    service_sigma: float = 0.75
    prefill_s: float = 0.05
    event_lag_s: float = 0.01
    index_entries: int = 100_000
    warmup: float = 0.1
    tokens_per_block: int = 64


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    service: float
    tenant: int
    conversation: int
    turn: int
    draw: float  # which process it reaches: int(draw * processes)
    keys: list[bytes]
    tokens: tuple[int, ...]  # one synthetic token per block, as the simulated replicas publish them


@dataclass(frozen=True, slots=True)
class Workload:
    tenants: list[VersionState]
    salts: list[str]
    requests: list[Request]
    conversations: int
    system_blocks: int  # blocks of all tenants' system prompts


def _token(key: bytes) -> int:
    return int.from_bytes(key[TAG_BYTES : TAG_BYTES + 8], "big") >> 1  # an int64, as vLLM's token ids are


def _block_hash(key: bytes) -> int:
    return int.from_bytes(key[TAG_BYTES + 8 :], "big")  # vLLM's own hash of the block: not kvgate's key


class ReplicaCache:
    """A replica's prefix cache in kvgate blocks: pinned blocks in use, freed ones in an LRU (vLLM-like).
    What enters or leaves it is published as KV events (``published``, drained by the simulation)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use: Counter[bytes] = Counter()
        self.free: OrderedDict[bytes, None] = OrderedDict()  # evictable, least recently freed first
        self.published: list[Event] = []

    def holds(self, key: bytes) -> bool:
        return key in self.in_use or key in self.free

    def cached_prefix(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if not self.holds(key):
                break
            count += 1
        return count

    def acquire(self, keys: Sequence[bytes], start: int, lora_name: str, salt: str) -> list[bytes]:
        """Pin ``keys[start:]`` (the leading ``start`` are pinned already, or none: ``start`` 0); a block
        not cached yet is stored and published. Returns the blocks it stored."""
        stored = []
        for position in range(start, len(keys)):
            key = keys[position]
            if not self.holds(key):
                parent = _block_hash(keys[position - 1]) if position else None
                extra = (lora_name, salt) if position == 0 else (lora_name,)
                self.published.append(
                    BlockStored((_block_hash(key),), parent, (_token(key),), 1, lora_name, (extra,))
                )
                stored.append(key)
            self.free.pop(key, None)
            self.in_use[key] += 1
        self._evict()
        return stored

    def pin(self, keys: Sequence[bytes]) -> None:
        """Pin blocks already cached (a request's hits)."""
        for key in keys:
            self.free.pop(key, None)
            self.in_use[key] += 1

    def release(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # vLLM frees in reverse order so that tail blocks are evicted first
            self.in_use[key] -= 1
            if self.in_use[key] <= 0:
                del self.in_use[key]
                self.free[key] = None
        self._evict()

    def _evict(self) -> None:
        while self.free and len(self.in_use) + len(self.free) > self.capacity:
            key, _ = self.free.popitem(last=False)
            self.published.append(BlockRemoved((_block_hash(key),)))


@dataclass
class Result:
    policy: Policy
    processes: int
    cache_blocks: int
    measured: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    missed: Counter[str] = field(default_factory=Counter)  # reason -> blocks
    missed_requests: Counter[str] = field(default_factory=Counter)  # reason -> requests with such a miss
    assigned: list[int] = field(default_factory=list)
    in_flight_area: list[float] = field(default_factory=list)
    decisions: Counter[str] = field(default_factory=Counter)

    def hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def load_ratio(self) -> float:
        mean = sum(self.assigned) / len(self.assigned)
        return max(self.assigned) / mean if mean else 0.0

    def in_flight_ratio(self) -> float:
        mean = sum(self.in_flight_area) / len(self.in_flight_area)
        return max(self.in_flight_area) / mean if mean else 0.0


# --- workload --------------------------------------------------------------------------------------------


def _words(rng: random.Random, count: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(count)]


def _text(rng: random.Random, vocabulary: list[str], chars: int) -> str:
    parts: list[str] = []
    length = 0
    while length < chars:
        word = rng.choice(vocabulary)
        parts.append(word)
        length += len(word) + 1
    return " ".join(parts)[:chars]


def build_workload(cfg: Config) -> Workload:
    """Conversations start as a Poisson process; turn k+1 arrives a think time after turn k's answer.
    The request rate keeps ``concurrency_per_replica`` x replicas requests in flight (Little's law)."""
    rng = random.Random(f"kvgate-prefix-routing/{cfg.seed}")
    vocabulary = _words(rng, 2048)
    tenants: list[VersionState] = []
    systems: list[str] = []
    for t in range(cfg.tenants):
        digest = blake3(f"{cfg.seed}/tenant-{t}".encode()).hexdigest()
        name = f"tenant-{t}@{digest[:16]}"
        tenants.append(VersionState(f"tenant-{t}", digest, name, f"/store/{digest}", BASE, 1))
        blocks = rng.randint(*cfg.system_blocks)
        systems.append(f"You are assistant {t}. " + _text(rng, vocabulary, blocks * BLOCK_CHARS))
    salts = [cache_salt(GENERATION, version) for version in tenants]
    weights = [1.0 / (rank + 1) ** cfg.zipf for rank in range(cfg.tenants)]
    order = list(range(cfg.tenants))
    rng.shuffle(order)  # popularity is independent of prompt length
    system_blocks = sum(
        len(content_keys(prompt_text({"messages": _system(systems[t])}))) for t in range(cfg.tenants)
    )

    rate = cfg.concurrency_per_replica * cfg.replicas / cfg.mean_service_s
    mean_turns = (cfg.turns[0] + cfg.turns[1]) / 2
    mu = -0.5 * cfg.service_sigma**2  # lognormal with mean 1, scaled by mean_service_s
    requests: list[Request] = []
    start = 0.0
    conversation = 0
    # enough conversations that the first ``requests`` turns by arrival are all there
    while len(requests) < 2 * cfg.requests:
        start += rng.expovariate(rate / mean_turns)
        tenant = order[rng.choices(range(cfg.tenants), weights)[0]]
        messages = _system(systems[tenant])
        now = start
        for turn in range(rng.randint(*cfg.turns)):
            question = f"Question {conversation}.{turn}: " + _text(
                rng, vocabulary, rng.randint(*cfg.question_blocks) * BLOCK_CHARS + rng.randrange(BLOCK_CHARS)
            )
            messages = [*messages, {"role": "user", "content": question}]
            keys = block_keys(salts[tenant], content_keys(prompt_text({"messages": messages})))
            service = max(cfg.mean_service_s * rng.lognormvariate(mu, cfg.service_sigma), 2 * cfg.prefill_s)
            tokens = tuple(_token(key) for key in keys)
            requests.append(Request(now, service, tenant, conversation, turn, rng.random(), keys, tokens))
            answer = _text(rng, vocabulary, rng.randint(*cfg.answer_blocks) * BLOCK_CHARS)
            messages = [*messages, {"role": "assistant", "content": answer}]
            now += service + rng.expovariate(1 / cfg.think_s)
        conversation += 1
    requests.sort(key=lambda r: r.arrival)
    kept = requests[: cfg.requests]
    return Workload(tenants, salts, kept, len({r.conversation for r in kept}), system_blocks)


def _system(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": text}]


# --- simulation ------------------------------------------------------------------------------------------


def _leading(keys: Sequence[bytes], present: set[bytes]) -> int:
    count = 0
    for key in keys:
        if key not in present:
            break
        count += 1
    return count


def simulate(policy: Policy, workload: Workload, cfg: Config, processes: int, cache_blocks: int) -> Result:
    urls = [f"http://replica-{i}:8000" for i in range(cfg.replicas)]
    listing = AdapterListing(BASE, None, {version.name: version.path for version in workload.tenants})
    views: list[list[Replica]] = []  # each process's own Replica objects: its own in-flight counts
    for _ in range(processes):
        own = [Replica(url) for url in urls]
        for replica in own:
            replica.healthy = True
            replica.listing = listing
        views.append(own)
    precise = PreciseIndex(10_000_000) if policy == "precise" else None
    schedulers = [Scheduler(cfg.index_entries, precise=precise) for _ in range(processes)]
    caches = {url: ReplicaCache(cache_blocks) for url in urls}
    position = {url: i for i, url in enumerate(urls)}
    ever: set[bytes] = set()  # every block any replica ever cached
    in_flight = dict.fromkeys(urls, 0)  # all processes' requests, for the load figures
    result = Result(
        policy, processes, cache_blocks, assigned=[0] * cfg.replicas, in_flight_area=[0.0] * cfg.replicas
    )

    requests = workload.requests
    first_measured = int(cfg.warmup * len(requests))
    measure_from = requests[first_measured].arrival if first_measured < len(requests) else 0.0
    measure_to = requests[-1].arrival  # steady state only: the drain after the last arrival is left out
    served_by: dict[int, tuple[int, Replica]] = {}  # request -> (its process, that process's replica)
    hits_of: dict[int, int] = {}
    pending: dict[int, tuple[str, list[Event]]] = {}  # published batches on their way to kvgate
    events: list[tuple[float, int, int]] = [(r.arrival, _ARRIVE, i) for i, r in enumerate(requests)]
    heapq.heapify(events)
    last = measure_from

    def publish(now: float, url: str) -> None:
        cache = caches[url]
        if cache.published:
            batch = len(pending)
            while batch in pending:
                batch += 1
            pending[batch] = (url, cache.published)
            cache.published = []
            heapq.heappush(events, (now + cfg.event_lag_s, _EVENT, batch))

    while events:
        now, kind, i = heapq.heappop(events)
        if measure_from < now and last < measure_to:
            span = min(now, measure_to) - last
            for url in urls:
                result.in_flight_area[position[url]] += in_flight[url] * span
            last = min(now, measure_to)
        if kind == _EVENT:
            url, batch_events = pending.pop(i)
            if precise is not None:
                precise.apply(url, batch_events)
            continue
        request = requests[i]
        version = workload.tenants[request.tenant]
        target = Target(
            version.logical_id, BASE, version, workload.salts[request.tenant], request.keys,
            tokens=request.tokens,
        )  # fmt: skip
        if kind == _COMPLETE:
            process, replica = served_by.pop(i)
            replica.end(version.name)
            in_flight[replica.url] -= 1
            caches[replica.url].release(request.keys)
            publish(now, replica.url)
            if policy != "least-loaded":
                schedulers[process].served(target, replica)  # as the proxy does on a 200
            continue
        if kind == _PREFILLED:
            _, replica = served_by[i]
            ever.update(
                caches[replica.url].acquire(request.keys, hits_of.pop(i), version.name, target.salt or "")
            )
            publish(now, replica.url)
            continue

        process = int(request.draw * processes)
        own = views[process]
        scheduler = schedulers[process]
        held = {url: caches[url].cached_prefix(request.keys) for url in urls}
        allowed = within_bound(eligible(own, target))  # as the decision sees the bound, before it begins
        if policy == "least-loaded":
            replica, decision, promised = least_loaded(eligible(own, target), b""), "least-loaded", 0
        else:
            choice = scheduler.decide(own, target)
            replica, promised = choice.replica, choice.matched_blocks
            decision = choice.reason if choice.reason != "prefix" else f"prefix ({choice.prefix_source})"
        hits = held[replica.url]
        caches[replica.url].pin(request.keys[:hits])
        replica.begin(version.name)
        in_flight[replica.url] += 1
        served_by[i] = (process, replica)
        hits_of[i] = hits
        heapq.heappush(events, (now + cfg.prefill_s, _PREFILLED, i))
        heapq.heappush(events, (now + request.service, _COMPLETE, i))
        if i < first_measured:
            continue
        result.measured += 1
        result.prompt_blocks += len(request.keys)
        result.hit_blocks += hits
        result.assigned[position[replica.url]] += 1
        result.decisions[decision] += 1
        misses = _misses(request, hits, held, allowed, promised, ever, scheduler, schedulers, precise, target)
        for reason, blocks in misses.items():
            if blocks > 0:
                result.missed[reason] += blocks
                result.missed_requests[reason] += 1
    return result


def _misses(
    request: Request,
    hits: int,
    held: dict[str, int],
    allowed: list[Replica],
    promised: int,
    ever: set[bytes],
    scheduler: Scheduler,
    schedulers: list[Scheduler],
    precise: PreciseIndex | None,
    target: Target,
) -> dict[str, int]:
    """The request's missed blocks by reason: peeled off from the prompt's end (blocks never cached
    anywhere) towards what the chosen replica held."""
    ever_cached = _leading(request.keys, ever)
    anywhere = max(held.values())
    best = max(allowed, key=lambda r: held[r.url])
    within = held[best.url]
    misses = {
        "first sight": len(request.keys) - ever_cached,
        "evicted": ever_cached - anywhere,
        "load bound": anywhere - within,
    }
    routing = within - hits
    if routing > 0:
        misses[
            _routing_reason(request, within, best, promised, hits, scheduler, schedulers, precise, target)
        ] = routing
    return misses


def _routing_reason(
    request: Request,
    within: int,
    best: Replica,
    promised: int,
    hits: int,
    scheduler: Scheduler,
    schedulers: list[Scheduler],
    precise: PreciseIndex | None,
    target: Target,
) -> str:
    """Why the decision missed blocks a replica within the bound held."""
    if precise is not None:
        seen = precise.held_blocks(
            (target.version.name if target.version else None, target.salt), target.tokens
        )
        if seen(best.url) < within:
            return "events in flight"
    if promised > hits:
        return "stale guess"
    if precise is None and scheduler.index.matched(request.keys, best.url) < within:
        if any(s.index.matched(request.keys, best.url) >= within for s in schedulers if s is not scheduler):
            return "another process's placement"
        return "not yet recorded"
    return "tie or load"


# --- report ----------------------------------------------------------------------------------------------


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


Runs = dict[tuple[int, Policy, int], Result]  # (cache blocks, policy, processes)


def _missed(r: Result, reason: str) -> str:
    if not r.missed[reason]:
        return "-"
    return f"{_pct(r.missed[reason], r.prompt_blocks)} ({_pct(r.missed_requests[reason], r.measured)})"


def _ratio(a: Result, b: Result) -> str:
    return f"{a.hit_ratio() / b.hit_ratio():.2f}x" if b.hit_ratio() else "n/a"


def render(cfg: Config, workload: Workload, runs: Runs, command: str) -> str:
    counts, caches = cfg.processes, cfg.cache_blocks
    top, low = max(counts), min(counts)
    tokens = cfg.tokens_per_block
    out = [
        "# Prefix routing with independent kvgate processes: predicted against precise (simulation)",
        "",
        "**A simulation that runs kvgate's real routing code, not a measurement on vLLM** (that is [further "
        f"down](#{REAL_ANCHOR})). Each kvgate process (a worker of `kvgate serve --workers N`, or a kvgate "
        "of its own) has its own "
        "`gateway.core.scheduler.Scheduler`: its own predicted `PrefixIndex`, fed as the proxy feeds it (a "
        "prompt is recorded when its answer completes, by the process that sent it), and its own `Replica` "
        "objects, whose in-flight counts the load bound reads. **predicted**: `Scheduler.decide` alone. "
        "**precise**: the same with a `gateway.kv.index.PreciseIndex` fed real `BlockStored`/`BlockRemoved` "
        "events, published by the simulated replicas when a block enters or leaves their cache and "
        f"delivered {cfg.event_lag_s * 1000:g} ms later (every process follows every replica, so every view "
        "is the same). The replicas' caches, arrivals, service times and which process a request reaches "
        "(uniformly at random, as `SO_REUSEPORT` spreads connections over workers) are simulated. "
        "Deterministic: this command (from the repository root) gives these figures exactly:",
        "",
        "```sh",
        command,
        "```",
        "",
        "Hit ratio: prompt blocks found in the chosen replica's cache over all prompt blocks (measured "
        f"requests); cached tokens ≈ hit blocks x {tokens}. Per-replica caches of "
        + " and ".join(f"{c:,}" for c in caches)
        + " blocks, the same workload:",
        "",
        "| cache blocks | processes | predicted hit ratio | precise hit ratio | precise / predicted "
        "| predicted ≈ cached tokens | precise ≈ cached tokens |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in caches:
        for n in counts:
            pred, prec = runs[c, "predicted", n], runs[c, "precise", n]
            out.append(
                f"| {c:,} | {n} | {pred.hit_ratio():.1%} | {prec.hit_ratio():.1%} | {_ratio(prec, pred)} | "
                f"{pred.hit_blocks * tokens:,} | {prec.hit_blocks * tokens:,} |"
            )
        base = runs[c, "least-loaded", top]
        out.append(
            f"| {c:,} | {top}, least-loaded (no prefix routing) | {base.hit_ratio():.1%} | | | "
            f"{base.hit_blocks * tokens:,} | |"
        )
    out.append("")
    for c in caches:
        pred1, pred8, prec8 = runs[c, "predicted", low], runs[c, "predicted", top], runs[c, "precise", top]
        prec1 = runs[c, "precise", low]
        out.append(
            f"- {c:,} blocks: at {top} processes precise keeps {prec8.hit_ratio():.1%} of prompt blocks "
            f"cached, predicted {pred8.hit_ratio():.1%} ({_ratio(prec8, pred8)}); at {low} process"
            f"{'es' if low > 1 else ''} {prec1.hit_ratio():.1%} and {pred1.hit_ratio():.1%}."
        )
    out += [
        "",
        "Why a prompt block was not a hit, as a share of all prompt blocks (each missed block has one "
        "reason; in parentheses the share of requests with such a miss):",
        "",
        "| cache blocks | processes | policy | hit | " + " | ".join(REASONS) + " |",
        "| ---: | ---: | --- | ---: | " + " | ".join("---:" for _ in REASONS) + " |",
    ]
    for c in caches:
        for n in counts:
            for policy in PAIRED:
                r = runs[c, policy, n]
                cells = [_missed(r, reason) for reason in REASONS]
                out.append(f"| {c:,} | {n} | {policy} | {r.hit_ratio():.1%} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Reasons: **first sight**: no replica had ever cached the block (a new question, or a block still "
        "being computed by a concurrent request); **evicted**: cached before, held by no replica any more; "
        "**load bound**: only replicas above this process's bounded share of in-flight requests "
        "(`within_bound`) held it; **another process's placement**: a replica within the bound held it, "
        "sent there by another process, unknown to this one's predicted index; **not yet recorded**: held "
        "within the bound, but the request that computed it had not completed, so no predicted index had "
        "it; **stale guess**: the index sent the request to a replica that had evicted what it promised; "
        "**events in flight**: precise: the holder's `BlockStored` had not reached kvgate yet; **tie or "
        "load**: the index knew the holder, the decision went elsewhere.",
        "",
        "Load and decisions (measured requests):",
        "",
        "| cache blocks | processes | policy | max/mean requests per replica | max/mean time-avg in-flight "
        "| decisions |",
        "| ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for c in caches:
        for n in counts:
            for policy in PAIRED:
                r = runs[c, policy, n]
                decisions = ", ".join(
                    f"{name} {_pct(k, r.measured)}" for name, k in sorted(r.decisions.items())
                )
                ratios = f"{r.load_ratio():.3f} | {r.in_flight_ratio():.3f}"
                out.append(f"| {c:,} | {n} | {policy} | {ratios} | {decisions} |")
        base = runs[c, "least-loaded", top]
        out.append(
            f"| {c:,} | {top} | least-loaded | {base.load_ratio():.3f} | {base.in_flight_ratio():.3f} | "
            "least-loaded 100.0% |"
        )
    turns = Counter(r.turn for r in workload.requests)
    later = sum(k for t, k in turns.items() if t > 0)
    out += [
        "",
        "Setup:",
        "",
        f"- {cfg.requests:,} requests from {workload.conversations:,} conversations (turns "
        f"{cfg.turns[0]}-{cfg.turns[1]}; {_pct(later, len(workload.requests))} of requests are a later "
        f"turn), the first {cfg.warmup:.0%} as warm-up (not counted); the same workload for every run. "
        f"Seed {cfg.seed}.",
        f"- {cfg.tenants} tenants (one adapter version and one `cache_salt` each), Zipf popularity (s = "
        f"{cfg.zipf:g}), each with a system prompt of {cfg.system_blocks[0]}-{cfg.system_blocks[1]} "
        f"blocks of {BLOCK_CHARS} characters ({workload.system_blocks:,} blocks in all). Turn k is a chat "
        f"body: the system prompt, the earlier questions and answers "
        f"({cfg.answer_blocks[0]}-{cfg.answer_blocks[1]} blocks each) and a new question "
        f"({cfg.question_blocks[0]}-{cfg.question_blocks[1]} blocks and a "
        "partial one), cut into blocks by `prompt_text` + `block_keys`; the next turn arrives a think "
        f"time (exponential, mean {cfg.think_s:g} s) after the answer.",
        f"- {cfg.replicas} replicas, each holding every version. Poisson conversation starts at "
        f"{cfg.concurrency_per_replica:g} x replicas requests in flight on average (Little's law), lognormal "
        f"service times (mean {cfg.mean_service_s:g} s, sigma {cfg.service_sigma:g}), prefill "
        f"{cfg.prefill_s * 1000:g} ms (the blocks a request computes are cached, and published, after it).",
        "- A request reaches process `int(u x N)` for a uniform u drawn once per request, so the same "
        "requests go to the same process in every run with N processes. Each predicted index holds "
        f"{cfg.index_entries:,} entries (the `prefix_index_entries` default).",
        "- Not modelled: prefill time falling with cache hits, replica queueing and preemption, polling "
        "and health changes, a lost event stream (kvgate empties that replica's view, says so on "
        "`/healthz`).",
    ]
    return "\n".join(out) + "\n"


def run(cfg: Config) -> tuple[Workload, Runs]:
    workload = build_workload(cfg)
    runs: Runs = {}
    top = max(cfg.processes)
    for c in cfg.cache_blocks:
        for n in cfg.processes:
            for policy in PAIRED:
                runs[c, policy, n] = simulate(policy, workload, cfg, n, c)
        runs[c, "least-loaded", top] = simulate("least-loaded", workload, cfg, top, c)
    return workload, runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    d = Config()
    parser.add_argument("--processes", type=int, nargs="+", default=list(d.processes))
    parser.add_argument("--replicas", type=int, default=d.replicas)
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--tenants", type=int, default=d.tenants)
    parser.add_argument("--zipf", type=float, default=d.zipf)
    parser.add_argument("--system-blocks", type=int, nargs=2, default=list(d.system_blocks))
    parser.add_argument("--turns", type=int, nargs=2, default=list(d.turns))
    parser.add_argument("--think-s", type=float, default=d.think_s)
    parser.add_argument(
        "--cache-blocks", type=int, nargs="+", default=list(d.cache_blocks), help="cached blocks per replica"
    )
    parser.add_argument("--concurrency-per-replica", type=float, default=d.concurrency_per_replica)
    parser.add_argument("--event-lag-s", type=float, default=d.event_lag_s)
    parser.add_argument("--warmup", type=float, default=d.warmup)
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    generated_docs.started_tree()  # the tree measured, taken before the run
    if min(args.processes) < 1 or args.replicas < 1 or args.requests < 1 or min(args.cache_blocks) < 1:
        parser.error("--processes, --replicas, --requests and --cache-blocks must be positive")
    cfg = Config(
        processes=tuple(sorted(set(args.processes))),
        replicas=args.replicas,
        requests=args.requests,
        seed=args.seed,
        tenants=args.tenants,
        zipf=args.zipf,
        system_blocks=(args.system_blocks[0], args.system_blocks[1]),
        turns=(args.turns[0], args.turns[1]),
        think_s=args.think_s,
        cache_blocks=tuple(args.cache_blocks),
        concurrency_per_replica=args.concurrency_per_replica,
        event_lag_s=args.event_lag_s,
        warmup=args.warmup,
    )
    started = time.process_time()
    workload, runs = run(cfg)
    seconds = time.process_time() - started
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join([".venv/bin/python", "-m", "loadtest.prefix_routing", *given])
    report = render(cfg, workload, runs, command)
    print(report)
    print(f"simulated in {seconds:.1f} s of CPU", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        generated_docs.write_report(args.out, report, command)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
