"""A tiny run of ``loadtest/prefix_routing.py`` (kvgate's scheduler, predicted index and precise index fed
by simulated KV events, over independent processes): every prompt block is accounted for, each miss
reason shows only where it can, and precise routing learns from the events alone. Fast: no servers."""

from __future__ import annotations

from dataclasses import replace

from loadtest.prefix_routing import PAIRED, REASONS, Config, Result, build_workload, render, run, simulate

TINY = Config(processes=(1, 4), replicas=2, requests=600, tenants=6, cache_blocks=(120,), think_s=2.0)


def accounted(result: Result) -> bool:
    return result.hit_blocks + sum(result.missed.values()) == result.prompt_blocks


def test_every_block_is_a_hit_or_a_miss_with_one_reason() -> None:
    workload, runs = run(TINY)
    assert len(runs) == 2 * len(PAIRED) + 1  # each policy at each process count, and least-loaded at the most
    for result in runs.values():
        assert result.measured > 0
        assert accounted(result), result
        assert set(result.missed) <= set(REASONS)
    for policy in PAIRED:  # one process: no other process to have placed anything
        assert runs[120, policy, 1].missed["another process's placement"] == 0
    for n in TINY.processes:  # the precise index never promises blocks by a guess
        assert runs[120, "precise", n].missed["another process's placement"] == 0
        assert runs[120, "predicted", n].missed["events in flight"] == 0
    assert runs[120, "predicted", 4].missed["another process's placement"] > 0
    assert runs[120, "precise", 4].hit_blocks > runs[120, "predicted", 4].hit_blocks
    report = render(TINY, workload, runs, "python -m loadtest.prefix_routing --requests 600")
    assert "python -m loadtest.prefix_routing --requests 600" in report
    assert "| 120 | 4 | precise |" in report


def test_precise_routing_knows_only_what_the_events_said() -> None:
    """With the replicas' events never arriving, precise decisions fall back to each process's predicted
    index, and what they miss for it is counted as events in flight."""
    cfg = replace(TINY, event_lag_s=1e9)
    workload = build_workload(cfg)
    deaf = simulate("precise", workload, cfg, 4, 120)
    assert accounted(deaf)
    assert deaf.missed["events in flight"] > 0
    assert not any(name.endswith("(precise)") for name in deaf.decisions)
    heard = simulate("precise", workload, TINY, 4, 120)
    assert heard.hit_blocks > deaf.hit_blocks
