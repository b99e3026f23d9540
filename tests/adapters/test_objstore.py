"""The content store on a real S3 API server (moto's, a process), through the production client.

Same digests as the directory store, a manifest written last, nothing ever overwritten, multipart for a
large file, ``max_adapter_bytes`` before a byte is sent; ``kvgate publish`` from a directory and from an
``s3://`` prefix, rollback and gc through the real CLI.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store

from gateway.adapters import gc
from gateway.adapters.manifest import parse
from gateway.adapters.objclient import STALL_S, open_client
from gateway.adapters.objstore import INCOMING, PART_BYTES, ObjectStore
from gateway.adapters.publish import publish_adapter
from gateway.adapters.store import AdapterStore
from gateway.core.errors import InvalidAdapter, StoreUnavailable
from gateway.table.epoch_table import EpochTable
from gateway.table.inventory import read_versions
from gateway.table.redis_server import EmbeddedRedis
from tests.support.adapter_files import MakeAdapter
from tests.support.s3_server import S3Server, cutting_proxy, environment, silent_endpoint

DAY = 86_400.0


def keys(store: ObjectStore) -> list[str]:
    return sorted(str(meta["path"]) for batch in obstore.list(store.client) for meta in batch)


def test_digest_and_layout_match_the_directory_store(
    s3_url: str, make_adapter: MakeAdapter, tmp_path: Path
) -> None:
    source = make_adapter(b"weights", extra={"sub/extra.bin": b"more"})
    stored = ObjectStore(s3_url).ingest(source)
    local = AdapterStore(tmp_path / "dir").ingest(source)
    assert stored.digest == local.digest
    assert stored.created
    assert stored.path == f"{s3_url}/{stored.digest}"
    d = stored.digest
    assert keys(ObjectStore(s3_url)) == sorted(
        [f"{d}.json", f"{d}/adapter_config.json", f"{d}/adapter_model.safetensors", f"{d}/sub/extra.bin"]
    )
    files = ObjectStore(s3_url).read_manifest(d)
    assert [(f.relpath, f.size) for f in files] == [
        (e.relpath, e.size) for e in AdapterStore(tmp_path).scan(source)
    ]
    assert ObjectStore(s3_url).proves(d, stored.path)
    assert not ObjectStore(s3_url).proves(d, str(local.path)), "a directory path is not this store's"


def test_nothing_is_overwritten(s3_url: str, make_adapter: MakeAdapter) -> None:
    store = ObjectStore(s3_url)
    source = make_adapter(b"v1")
    first = store.ingest(source)
    again = store.ingest(source)
    assert (first.created, again.created) == (True, False)
    with pytest.raises(obstore.exceptions.AlreadyExistsError):  # the store's own guarantee, by the API
        obstore.put(store.client, store.manifest_key(first.digest), b"{}", mode="create")
    # A file left under the digest by a publish that stopped, holding other bytes: refused, not replaced.
    other = make_adapter(b"v2")
    planned = ObjectStore(s3_url).ingest(other)
    store.delete_manifest(planned.digest)
    obstore.put(store.client, f"{planned.digest}/adapter_model.safetensors", b"tampered")
    with pytest.raises(StoreUnavailable, match="exists with other bytes"):
        store.ingest(other)
    assert not store.contains(planned.digest)


def test_a_large_file_goes_up_in_parts(s3: S3Server, s3_url: str, make_adapter: MakeAdapter) -> None:
    weights = os.urandom(PART_BYTES * 2 + 12345)
    store = ObjectStore(s3_url)
    stored = store.ingest(make_adapter(weights))
    meta = obstore.head(store.client, f"{stored.digest}/adapter_model.safetensors")
    assert meta["size"] == len(weights)
    assert "-" in str(meta["e_tag"]), f"put in place by a (conditional) multipart copy, not {meta['e_tag']}"
    bucket = s3_url.split("/")[2]
    parts = [line for line in s3.log.read_text().splitlines() if f"/{bucket}/store/.incoming/" in line]
    assert any("partNumber=3&" in line for line in parts), "uploaded in three parts"
    assert all(not k.startswith(".incoming/") for k in keys(store)), "the staged upload is deleted"


def test_max_adapter_bytes_is_enforced_before_upload(s3_url: str, make_adapter: MakeAdapter) -> None:
    store = ObjectStore(s3_url, max_bytes=1000)
    with pytest.raises(InvalidAdapter, match="over max_adapter_bytes"):
        store.ingest(make_adapter(b"x" * 2000))
    assert keys(store) == []


def test_an_unreachable_store_is_a_clear_error(make_adapter: MakeAdapter, s3: S3Server) -> None:
    with environment({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}):
        store = ObjectStore("s3://nowhere/store")
    with pytest.raises(StoreUnavailable, match=r"reading s3://nowhere/store/.*error sending request"):
        store.ingest(make_adapter(b"v1"))


async def test_a_store_that_never_answers_fails_publish_within_its_deadline_naming_the_call(
    redis_server: EmbeddedRedis, s3: S3Server, make_adapter: MakeAdapter
) -> None:
    """A real socket that accepts and never answers: the library alone would wait for ever (its overall
    request timeout, 300 s, then each further call's); each call stalls out after STALL_S."""
    source = make_adapter(b"v1")
    with silent_endpoint() as endpoint, environment({"AWS_ENDPOINT_URL": endpoint}):
        started = time.monotonic()
        code, _, err = await run_cli(
            "publish", "t", str(source), "--store", "s3://bucket/store", redis=redis_server, within=60
        )
        took = time.monotonic() - started
    assert code != 0, err
    assert took < STALL_S + 20, f"the deadline held: {took:.1f} s"
    assert re.search(r"reading s3://bucket/store/[0-9a-f]{64}\.json failed: timed out", err), err


def test_a_store_that_goes_away_mid_upload_names_the_upload_not_its_cleanup(
    s3: S3Server, s3_url: str, make_adapter: MakeAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    """The store drops every connection half way through a large file's first part and refuses every
    later one, so the staged upload cannot be deleted either: the error is the upload's."""
    source = make_adapter(os.urandom(PART_BYTES * 2 + 1))
    with cutting_proxy(s3.endpoint, after_bytes=PART_BYTES // 2) as proxy:
        with environment({"AWS_ENDPOINT_URL": proxy.endpoint}):
            store = ObjectStore(s3_url)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as failed:
            store.ingest(source)
        took = time.monotonic() - started
    assert proxy.cut.is_set()
    message = str(failed.value)
    assert re.match(r"uploading 'adapter_model.safetensors' to s3://.*/\.incoming/\w+ failed: ", message), (
        message
    )
    assert "connection refused" in message, message
    assert took < STALL_S, f"refused, so no deadline was needed: {took:.1f} s"
    left = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(line.startswith("deleting ") and "kvgate gc removes it" in line for line in left), left


def test_a_manifest_that_does_not_hash_to_its_digest_is_refused(
    s3_url: str, make_adapter: MakeAdapter
) -> None:
    store = ObjectStore(s3_url)
    stored = store.ingest(make_adapter(b"v1"))
    doc = json.loads(store.manifest_bytes(stored.digest))
    doc["files"][1]["size"] += 1
    with pytest.raises(StoreUnavailable, match="do not hash"):
        parse(json.dumps(doc).encode(), stored.digest)


async def test_publish_rollback_and_gc_on_the_object_store(
    table: EpochTable, s3_url: str, make_adapter: MakeAdapter
) -> None:
    store = ObjectStore(s3_url)
    v1 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v1"), "base")
    v2 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v2"), "base")
    v3 = await publish_adapter(table, store, "tenant-42", make_adapter(b"v3"), "base")
    assert v1.path == f"{s3_url}/{v1.digest}"
    change = await table.rollback("tenant-42", v1.digest, "base")
    assert change.digest == v1.digest
    later = 10 * DAY + time.time()
    report = await gc.sweep(table, store, gc.Policy(keep_last=1, retention_s=DAY), now=later)
    assert report.removed == [v2.digest], "v1 is current (rolled back to), v3 the last published; v2 goes"
    assert store.contains(v3.digest)
    assert store.contains(v1.digest)
    assert not store.contains(v2.digest)
    assert not [k for k in keys(store) if k.startswith(v2.digest)], "no object of v2 is left"
    assert v2.digest not in {r.digest for r in await read_versions(table, "tenant-42")}


async def test_gc_removes_a_killed_publishs_staged_upload_once_it_is_old(
    table: EpochTable, s3_url: str, make_adapter: MakeAdapter
) -> None:
    store = ObjectStore(s3_url)
    kept = await publish_adapter(table, store, "a", make_adapter(b"1"), "base")
    staged = f"{INCOMING}{'0' * 16}"  # what a publish killed mid-upload leaves (its finally never ran)
    obstore.put(store.client, staged, b"x" * 1000)
    policy = gc.Policy(keep_last=1, retention_s=DAY)
    young = await gc.sweep(table, store, policy)
    assert young.leftovers == [], "just written: it may be a publish under way"
    assert staged in keys(store)
    later = 10 * DAY + time.time()
    dry = await gc.sweep(table, store, policy, dry_run=True, now=later)
    assert [(item.path, item.bytes) for item in dry.leftovers] == [(staged, 1000)]
    assert staged in keys(store)
    done = await gc.sweep(table, store, policy, now=later)
    assert [item.path for item in done.leftovers] == [staged]
    assert staged not in keys(store)
    assert store.contains(kept.digest)


async def test_gc_keeps_what_a_publish_touched(
    table: EpochTable, s3_url: str, make_adapter: MakeAdapter
) -> None:
    store = ObjectStore(s3_url)
    await publish_adapter(table, store, "a", make_adapter(b"old"), "base")
    await publish_adapter(table, store, "a", make_adapter(b"new"), "base")
    entries = await gc.collect(table, store, gc.Policy(keep_last=1, retention_s=DAY))
    assert all("young" in entry.kept_because for entry in entries), "just written: young"


async def run_cli(*args: str, redis: EmbeddedRedis, within: float = 120) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", *args, "--redis-url", redis.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=within)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_cli_publishes_from_a_directory_and_from_s3_then_rolls_back_and_gcs(
    table: EpochTable, redis_server: EmbeddedRedis, s3: S3Server, s3_url: str, make_adapter: MakeAdapter
) -> None:
    first = make_adapter(b"from-a-directory")
    code, out, err = await run_cli(
        "publish", "tenant-7", str(first), "--json", "--store", s3_url, redis=redis_server
    )
    assert code == 0, err
    v1 = json.loads(out)
    assert v1["path"] == f"{s3_url}/{v1['digest']}"
    # A training pipeline's output in another bucket, published from there.
    pipeline = S3Store.from_url(f"s3://{s3.new_bucket()}/runs/42", client_options={"allow_http": True})
    second = make_adapter(b"from-a-bucket", extra={"tokenizer/vocab.txt": b"a b c"})
    for path in sorted(p for p in second.rglob("*") if p.is_file()):
        obstore.put(pipeline, path.relative_to(second).as_posix(), path.read_bytes())
    source = f"s3://{pipeline.config['bucket']}/runs/42"
    code, out, err = await run_cli(
        "publish", "tenant-7", source, "--json", "--store", s3_url, redis=redis_server
    )
    assert code == 0, err
    v2 = json.loads(out)
    assert v2["digest"] == AdapterStore(second.parent / "check").ingest(second).digest, "the same bytes"
    code, out, err = await run_cli(
        "rollback", "tenant-7", v1["digest"], "--json", "--store", s3_url, redis=redis_server
    )
    assert code == 0, err
    assert json.loads(out)["digest"] == v1["digest"]
    code, out, err = await run_cli("gc", "--dry-run", "--json", "--store", s3_url, redis=redis_server)
    assert code == 0, err
    kept = {e["digest"]: e["kept_because"] for e in json.loads(out)["entries"]}
    assert "current" in kept[v1["digest"]]
    assert "young" in kept[v2["digest"]]
    sizes = {e["digest"]: e["bytes"] for e in json.loads(out)["entries"]}
    assert sizes[v2["digest"]] == sum(p.stat().st_size for p in second.rglob("*") if p.is_file())


async def test_publish_from_an_s3_prefix_over_the_limit_downloads_nothing(
    redis_server: EmbeddedRedis, s3: S3Server, s3_url: str
) -> None:
    bucket = s3.new_bucket()
    pipeline = open_client(f"s3://{bucket}/big")
    obstore.put(pipeline, "adapter_model.safetensors", b"x" * 5000)
    code, _, err = await run_cli(
        "publish",
        "t",
        f"s3://{bucket}/big",
        "--store",
        s3_url,
        "--max-adapter-bytes",
        "1000",
        redis=redis_server,
    )
    assert code != 0, err
    assert "over max_adapter_bytes" in err, err
    assert keys(ObjectStore(s3_url)) == []
