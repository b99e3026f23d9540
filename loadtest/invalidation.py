"""Invalidation strategies side by side, on real vLLM CPU replicas: who stays warm across an update?

N tenants, each with a long system prompt of its own (several KV blocks) and a short varying question,
send steady traffic through kvgate. Then one tenant's adapter is updated (new bytes, same logical ID).
Per strategy (``version-scoped``, ``purge-all``), per tenant and per phase, the run measures the
cached-token ratio (``usage.prompt_tokens_details.cached_tokens / prompt_tokens``, from the stream's
final usage chunk) and the time to first token, then writes a markdown table and a PNG plot.

    .venv/bin/python -m loadtest.invalidation --vllm-python .venv-vllm/bin/python \\
        --fixture-dir .cache/fixture --out docs/invalidation.md --plot docs/invalidation.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.app.wiring import build_app
from gateway.dev import generated_docs
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, start_replicas
from gateway.process.http_edge import free_port, running
from gateway.proof.audit import GatewayTarget, audit_round
from gateway.settings.model import Settings
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.telemetry.metrics import Metrics

STRATEGIES = ("version-scoped", "purge-all")
TOKEN = "loadtest-admin-token"
_TOPICS = ("harbor schedules", "bakery orders", "library loans", "train timetables", "garden plans")


@dataclass(frozen=True)
class Observation:
    strategy: str
    tenant: str
    updated: bool
    phase: str  # "before" | "after"
    index: int  # request number within the strategy run
    cached_ratio: float
    ttft_s: float


def system_prompt(tenant: int) -> str:
    topic = _TOPICS[tenant % len(_TOPICS)]
    line = f"You are the assistant for tenant {tenant}, who manages {topic}. Answer briefly and politely. "
    return line * 12  # about 300 tokens with the fixture tokenizer: two full KV blocks and more


async def streamed_request(
    http: aiohttp.ClientSession, url: str, model: str, prompt: str
) -> tuple[float, float]:
    """One streaming completion: (cached-token ratio, seconds to the first token)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    usage: dict[str, object] = {}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    prompt_tokens = int(str(usage.get("prompt_tokens") or 0))
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return (cached / prompt_tokens if prompt_tokens else 0.0), (ttft or 0.0)


async def run_strategy(
    strategy: str,
    replicas: list[VllmProcess],
    redis: Redis,
    store: AdapterStore,
    fixture_dir: Path,
    *,
    tenants: int,
    rounds: int,
    audits: dict[str, str],
) -> list[Observation]:
    """Steady traffic, one tenant's update, more traffic; then the updated tenant is audited."""
    await redis.flushdb()
    table = EpochTable(redis)
    settings = Settings(
        replicas=[r.url for r in replicas],
        store=store.root,
        reconcile_interval=0.2,
        poll_interval=0.5,
        drain_grace=2.0,
        invalidation=strategy,
        admin_token=TOKEN,
    )
    metrics = Metrics()
    names = [f"tenant-{i}" for i in range(tenants)]
    adapters = [fixture_dir / "adapters" / f"v{(i % 2) + 1}" for i in range(tenants)]
    observations: list[Observation] = []
    async with running(build_app(settings, redis, metrics=metrics)) as url, aiohttp.ClientSession() as http:
        for name, adapter in zip(names, adapters, strict=True):
            done = await publish_adapter(table, store, name, adapter, settings.base_identity)
            await GatewayTarget(url, name, TOKEN).until_serving(http, done.digest)

        async def traffic(phase: str) -> None:
            for k in range(rounds):
                for i, name in enumerate(names):
                    prompt = f"{system_prompt(i)} Question {phase} {k}: what is next?"
                    ratio, ttft = await streamed_request(http, url, name, prompt)
                    observations.append(
                        Observation(strategy, name, i == 0, phase, len(observations), ratio, ttft)
                    )

        await traffic("before")
        update = await publish_adapter(table, store, names[0], fixture_dir / "adapters" / "v3", "base")
        await GatewayTarget(url, names[0], TOKEN).until_serving(http, update.digest)
        if strategy == "purge-all":
            await _until_purged(metrics, replicas)
        await traffic("after")
        verdicts = await audit_round(http, GatewayTarget(url, names[0], TOKEN))
        audits[strategy] = ", ".join(sorted({v.verdict for v in verdicts}))
    return observations


async def _until_purged(metrics: Metrics, replicas: list[VllmProcess]) -> None:
    for _ in range(300):
        done = sum(
            metrics.registry.get_sample_value(
                "kvgate_prefix_purges_total", {"replica": r.url, "outcome": "purged"}
            )
            or 0
            for r in replicas
        )
        if done >= len(replicas):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("purge-all did not purge every replica in 30 s")


def summarize(observations: list[Observation], rounds: int, tenants: int) -> str:
    """Markdown: per strategy and tenant group, cached ratio and TTFT before, right after, and after."""
    lines = [
        "| strategy | tenants | cached ratio before | right after update | after (all rounds) "
        "| TTFT p50 before (ms) | TTFT p50 right after (ms) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for strategy in STRATEGIES:
        for updated, label in ((True, "updated tenant"), (False, f"{tenants - 1} unrelated tenants")):
            group = [o for o in observations if o.strategy == strategy and o.updated == updated]
            before = [o for o in group if o.phase == "before" and o.index >= tenants]  # skip cold first round
            after = [o for o in group if o.phase == "after"]
            first_after = after[: len(after) // rounds] if after else []
            ratios = f"{_mean(before):.2f} | {_mean(first_after):.2f} | {_mean(after):.2f}"
            lines.append(
                f"| {strategy} | {label} | {ratios} | {_p50_ms(before):.0f} | {_p50_ms(first_after):.0f} |"
            )
    return "\n".join(lines)


def _mean(group: list[Observation]) -> float:
    return statistics.fmean(o.cached_ratio for o in group) if group else float("nan")


def _p50_ms(group: list[Observation]) -> float:
    return statistics.median(o.ttft_s for o in group) * 1000 if group else float("nan")


def plot(observations: list[Observation], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(STRATEGIES), figsize=(12, 4), sharey=True)
    for axis, strategy in zip(axes, STRATEGIES, strict=True):
        runs = [o for o in observations if o.strategy == strategy]
        for tenant in sorted({o.tenant for o in runs}):
            points = [o for o in runs if o.tenant == tenant]
            style = "-o" if points[0].updated else "--."
            axis.plot([o.index for o in points], [o.cached_ratio for o in points], style, label=tenant)
        first_after = min(o.index for o in runs if o.phase == "after")
        axis.axvline(first_after - 0.5, color="red", linestyle=":", label="update of tenant-0")
        axis.set_title(strategy)
        axis.set_xlabel("request #")
        axis.set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("cached-token ratio")
    axes[-1].legend(loc="lower right", fontsize=8)
    figure.suptitle("Prefix-cache reuse across one tenant's adapter update (real vLLM CPU, 2 replicas)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvgate-invalidation-"))
    specs = [
        VllmReplicaSpec(args.vllm_python, args.fixture_dir / "model", free_port(), work / f"vllm-{i}.log")
        for i in (0, 1)
    ]
    with EmbeddedRedis(work) as redis_server:
        redis = Redis.from_url(redis_server.url)
        replicas = await start_replicas(specs)
        try:
            observations: list[Observation] = []
            audits: dict[str, str] = {}
            store = AdapterStore(work / "store")
            for strategy in STRATEGIES:
                observations += await run_strategy(
                    strategy,
                    replicas,
                    redis,
                    store,
                    args.fixture_dir,
                    tenants=args.tenants,
                    rounds=args.rounds,
                    audits=audits,
                )
        finally:
            await asyncio.gather(*(r.stop() for r in replicas))
            await redis.aclose()
    table = summarize(observations, args.rounds, args.tenants)
    table += "\n\nAudit of the updated tenant after the run (`kvgate audit` through kvgate, every replica): "
    table += "; ".join(f"{strategy}: {verdict}" for strategy, verdict in audits.items())
    report = f"{args.tenants} tenants, {args.rounds} rounds per phase.\n\n{table}\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    generated_docs.write_block(args.out, generated_docs.measured(report))
    plot(observations, args.plot)
    print(report)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--fixture-dir", type=Path, required=True)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("docs/invalidation.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/invalidation.png"))
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
