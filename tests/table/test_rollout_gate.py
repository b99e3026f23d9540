"""The rollout gate's shared state (issue 28, item 6) on a real redis-server: the lease on a rollout's gate
is taken, held, renewed by its holder's asks and taken over once its holder stops asking (its time to
live); audit rounds are at least an interval apart fleet-wide, across a take-over too; a stopping holder
lets go at once; the fleet-wide counts add up what two processes add at the same time."""

from __future__ import annotations

import asyncio
import sys

from redis.asyncio import Redis

from gateway.table import keys
from gateway.table.epoch_table import EpochTable
from gateway.table.redis_server import EmbeddedRedis
from gateway.table.rollout_gate import GateTable, read_counts, read_holder
from gateway.telemetry.rollout_stats import VersionFigures

ID, DIGEST = "tenant-42", "ab" * 32
TTL_MS, INTERVAL_MS = 3_000, 1_000


class Clock:
    def __init__(self) -> None:
        self.ms = 1_900_000_000_000

    def __call__(self) -> int:
        return self.ms


def gates(redis: Redis, clock: Clock, *names: str) -> list[GateTable]:
    table = EpochTable(redis, clock=clock)
    return [GateTable(table, name, ttl_ms=TTL_MS, interval_ms=INTERVAL_MS) for name in names]


async def test_the_lease_is_taken_held_and_taken_over_after_its_holders_ttl(redis: Redis) -> None:
    clock = Clock()
    a, b = gates(redis, clock, "gw-a", "gw-b")
    first = await a.take_turn(ID, DIGEST)
    assert (first.holder, first.mine, first.due, first.round_ms) == ("gw-a", True, True, clock.ms)
    refused = await b.take_turn(ID, DIGEST)
    assert (refused.holder, refused.mine, refused.due) == ("gw-a", False, False), (
        "held: b neither judges nor audits"
    )

    clock.ms += INTERVAL_MS // 2  # a's ticks renew its lease; no round due within the interval
    held = await a.take_turn(ID, DIGEST)
    assert (held.mine, held.due, held.until_ms, held.round_ms) == (
        True,
        False,
        clock.ms + TTL_MS,
        first.round_ms,
    )
    clock.ms += INTERVAL_MS // 2
    assert (await a.take_turn(ID, DIGEST)).due, "a round an interval after the last"
    last_round = clock.ms

    clock.ms += TTL_MS - 1  # a stops asking (it died): its lease stands until its time to live is over
    assert not (await b.take_turn(ID, DIGEST)).mine
    holder = await read_holder(a.table, ID, DIGEST)
    assert holder is not None
    assert holder.holder == "gw-a"
    clock.ms += 1
    taken = await b.take_turn(ID, DIGEST)
    assert (taken.holder, taken.mine, taken.due, taken.round_ms) == ("gw-b", True, True, clock.ms)
    assert taken.round_ms - last_round >= INTERVAL_MS
    assert not (await a.take_turn(ID, DIGEST)).mine, "a back: b holds it now"
    assert await redis.pttl(keys.rollout_gate(ID, DIGEST)) > 0, "the key expires once nobody asks"


async def test_a_take_over_keeps_the_fleets_interval_and_a_stopping_holder_lets_go_at_once(
    redis: Redis,
) -> None:
    clock = Clock()
    a, b = gates(redis, clock, "gw-a", "gw-b")
    assert (await a.take_turn(ID, DIGEST)).due
    assert not await b.release(ID, DIGEST), "b holds nothing to let go of"
    assert await a.release(ID, DIGEST)
    assert await read_holder(a.table, ID, DIGEST) is None
    clock.ms += 10
    taken = await b.take_turn(ID, DIGEST)
    assert (taken.holder, taken.mine, taken.due) == ("gw-b", True, False), "b holds it, no round yet"
    clock.ms += INTERVAL_MS - 10
    assert (await b.take_turn(ID, DIGEST)).due
    other = await a.take_turn(ID, "cd" * 32)
    assert (other.mine, other.due) == (True, True), "another rollout (candidate digest) has a gate of its own"


async def test_only_the_holder_renews_its_lease_and_a_renewal_starts_no_round(redis: Redis) -> None:
    clock = Clock()
    a, b = gates(redis, clock, "gw-a", "gw-b")
    first = await a.take_turn(ID, DIGEST)
    clock.ms += TTL_MS + INTERVAL_MS  # an audit round longer than the lease: a renews as it runs
    assert await a.renew(ID, DIGEST)
    holder = await read_holder(a.table, ID, DIGEST)
    assert holder is not None
    assert (holder.holder, holder.until_ms, holder.round_ms) == ("gw-a", clock.ms + TTL_MS, first.round_ms)
    assert not (await b.take_turn(ID, DIGEST)).mine, "renewed: b waits"
    before = await redis.hgetall(keys.rollout_gate(ID, DIGEST))
    assert not await b.renew(ID, DIGEST), "b holds nothing to renew"
    assert await redis.hgetall(keys.rollout_gate(ID, DIGEST)) == before, "and wrote nothing"


ADD = """
import asyncio, sys
from redis.asyncio import Redis
from gateway.table.epoch_table import EpochTable
from gateway.table.rollout_gate import GateTable
from gateway.telemetry.rollout_stats import VersionFigures

async def main(url, name, times):
    redis = Redis.from_url(url)
    gate = GateTable(EpochTable(redis), name, ttl_ms=3000, interval_ms=1000)
    for i in range(times):
        await gate.add("tenant-42", "ab" * 32, {
            "candidate": VersionFigures(requests=2, errors=1, first_bytes=2, first_byte_us=1500),
            "current": VersionFigures(requests=3, errors=i % 2),
        })
    await redis.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_counts_added_by_two_processes_at_once_add_up(
    redis: Redis, redis_server: EmbeddedRedis
) -> None:
    times = 200
    processes = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", ADD, redis_server.url, name, str(times))
        for name in ("gw-a", "gw-b")
    ]
    assert [await p.wait() for p in processes] == [0, 0]
    figures = await read_counts(EpochTable(redis), ID, DIGEST)
    assert figures["candidate"] == VersionFigures(requests=4 * times, errors=2 * times, first_bytes=4 * times,
                                                  first_byte_us=3000 * times)  # fmt: skip
    assert figures["current"] == VersionFigures(requests=6 * times, errors=times)
    assert figures["candidate"].to_json()["ttfb_mean_s"] == 0.00075
    assert await redis.pttl(keys.rollout_counts(ID, DIGEST)) > 0, "the counts expire once nobody adds"


async def test_a_counts_field_kvgate_does_not_write_is_skipped_not_trusted(redis: Redis) -> None:
    key = keys.rollout_counts(ID, DIGEST)
    await redis.hset(key, mapping={"candidate:requests": "5", "candidate:errors": "-1", "odd:requests": "2",
                                   "current:requests": "junk", "current:errors": "1"})  # fmt: skip
    figures = await read_counts(EpochTable(redis), ID, DIGEST)
    assert figures["candidate"] == VersionFigures(requests=5)
    assert figures["current"] == VersionFigures(errors=1)
