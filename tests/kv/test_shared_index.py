"""The shared KV index (``kv.shared_index``): the indexer's writes as a worker reads them, over a real
shared memory file mapped twice (as the indexer and a worker map it)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gateway.core.errors import KvgateError
from gateway.kv.events import BlockRemoved, BlockStored
from gateway.kv.index import PreciseIndex, block_keys, table_key
from gateway.kv.shared_index import Layout, SharedReader, SharedRegion, SharedWriter, create

REPLICAS = ["http://r0:8000", "http://r1:8000"]


@pytest.fixture
def shared() -> Iterator[tuple[SharedWriter, SharedReader]]:
    fd = create(100, REPLICAS)
    writer = SharedWriter(SharedRegion(fd, REPLICAS))
    writer.start(1)
    reader = SharedReader(SharedRegion(fd, REPLICAS))
    yield writer, reader
    writer.close()
    reader.region.close()
    os.close(fd)


def test_holds_and_releases_read_back_as_a_model_of_them_says(
    shared: tuple[SharedWriter, SharedReader],
) -> None:
    writer, reader = shared
    rng = random.Random(7)
    model: dict[int, int] = {}
    keys = [rng.getrandbits(64) | 1 for _ in range(150)]  # colliding home slots on a 1024-slot table too
    keys += [k ^ (1 << 40) for k in keys[:50]]  # same low bits: one probe run
    for _ in range(5000):
        key, column = rng.choice(keys), rng.randrange(4)
        if rng.random() < 0.55:
            writer.hold(key, column)
            model[key] = model.get(key, 0) | 1 << column
        else:
            writer.release(key, column)
            model[key] = model.get(key, 0) & ~(1 << column)
        if rng.random() < 0.05:
            assert all(reader.lookup(k) == model.get(k, 0) for k in keys)
    assert all(reader.lookup(k) == model.get(k, 0) for k in keys)
    assert reader.gave_up == 0


def test_a_request_matches_what_a_replicas_view_holds_and_nothing_once_it_is_removed(
    shared: tuple[SharedWriter, SharedReader],
) -> None:
    writer, reader = shared
    index = PreciseIndex(100, mirror=writer)
    tokens = tuple(range(40))
    namespace = ("t@1", "kvg-abc")
    stored = BlockStored((11, 12, 13), None, tokens[:30], 10, "t@1", (("t@1", "kvg-abc"), ("t@1",), ("t@1",)))
    index.apply(REPLICAS[1], [stored], 0)
    for url in REPLICAS:
        writer.report(url, "following", {}, 0.1, index.blocks(url), None, 0)
    held = reader.held_blocks(namespace, tokens)
    assert (held(REPLICAS[0]), held(REPLICAS[1])) == (0, 3)
    assert reader.held_blocks(("t@2", "kvg-abc"), tokens)(REPLICAS[1]) == 0  # another version's namespace
    index.apply(REPLICAS[1], [BlockRemoved((13,))], 0)
    assert reader.held_blocks(namespace, tokens)(REPLICAS[1]) == 2
    writer.report(REPLICAS[1], "lagging", {"reason": "behind"}, 9.0, 2, None, 4)
    assert reader.held_blocks(namespace, tokens)(REPLICAS[1]) == 0  # lagging: routed as predicted
    events = reader.events(REPLICAS[1])
    assert (events.state, events.health, events.lag_s, events.dropped) == (
        "lagging",
        {"reason": "behind"},
        9.0,
        4,
    )
    writer.report(REPLICAS[1], "following", {}, 0.1, 2, None, 4)
    reader.purged(REPLICAS[1])  # what workers tell the indexer: counts it acts on when they move
    reader.restarted(REPLICAS[1])
    reader.restarted(REPLICAS[1])
    counts = writer.purges(REPLICAS[1]), writer.restarts(REPLICAS[1]), writer.restarts(REPLICAS[0])
    assert counts == (1, 2, 0)
    index.clear(REPLICAS[1])
    assert reader.held_blocks(namespace, tokens)(REPLICAS[1]) == 0
    assert all(reader.lookup(table_key(k)) == 0 for k in block_keys(namespace, tokens, 10))


def test_a_file_for_other_replicas_or_of_another_layout_is_refused() -> None:
    fd = create(10, REPLICAS)
    try:
        with pytest.raises(KvgateError, match="another list of replicas"):
            SharedRegion(fd, REPLICAS[:1])
        os.pwrite(fd, b"\0" * 8, 0)
        with pytest.raises(KvgateError, match="another layout"):
            SharedRegion(fd, REPLICAS)
    finally:
        os.close(fd)


def test_the_layout_keeps_the_table_at_most_half_full() -> None:
    layout = Layout.sized(1_000_000, 100)
    assert layout.capacity == 2**21
    assert layout.words == 4
    assert Layout.sized(0, 1).capacity == 1024


WRITER = """
import sys, time
from gateway.kv.shared_index import SharedRegion, SharedWriter
fd, replicas, keys = int(sys.argv[1]), sys.argv[2].split(","), [int(k) for k in sys.argv[3].split(",")]
writer = SharedWriter(SharedRegion(fd, replicas))
end = time.monotonic() + float(sys.argv[4])
rounds = 0
while time.monotonic() < end:
    for i, key in enumerate(keys):  # key i is only ever held in column i % 2
        writer.hold(key, i % 2)
    for i, key in enumerate(keys):
        writer.release(key, i % 2)
    rounds += 1
print(rounds)
"""


def test_a_reader_beside_a_busy_writer_process_never_sees_a_key_in_another_keys_column() -> None:
    """A real writer process holds and releases keys that share one probe run (so deletions shift
    entries over the slots a reader is reading) while this process reads them: a key is only ever in
    its own column, never in the column of the entry that moved into its slot mid-read (the seqlock)."""
    fd = create(100, REPLICAS)
    try:
        writer = SharedWriter(SharedRegion(fd, REPLICAS))
        writer.start(1)
        keys = [(i << 32) | 5 for i in range(1, 40)]  # one home slot: a single probe run
        command = [sys.executable, "-c", WRITER, str(fd), ",".join(REPLICAS), ",".join(map(str, keys)), "3"]
        process = subprocess.Popen(command, pass_fds=[fd], stdout=subprocess.PIPE)
        reader = SharedReader(SharedRegion(fd, REPLICAS))
        seen = wrong = 0
        while process.poll() is None:
            for i, key in enumerate(keys):
                held = reader.lookup(key)
                seen += bool(held)
                wrong += bool(held & ~(1 << (i % 2)))
        out, _ = process.communicate()
        assert process.returncode == 0
        assert int(out) > 10, "the writer ran"
        assert seen > 0, "the reader saw the keys held"
        assert wrong == 0
        reader.region.close()
        writer.close()
    finally:
        os.close(fd)
