"""Each base's tokenizer found by kvgate itself (``kv.tokenizers``), the fallbacks when it cannot be, and
where an operator sees them: a replica's routing trust on ``/healthz`` and in ``kvgate_routing_trust``
(real tokenizers trained here, real Redis and stub replicas; the real-vLLM proof is
tests/vllm/test_precise_vllm.py's second kvgate with default settings)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gateway.app.wiring import build_app
from gateway.core.wire import replica_id
from gateway.fleet.backends.answers import AdapterListing
from gateway.fleet.replicas import Replica
from gateway.kv.prompt_tokens import Unrendered
from gateway.kv.tokenizers import SETTING, Tokenizers
from gateway.process.http_edge import running
from gateway.settings.model import Settings
from tests.support.conditions import eventually
from tests.support.stub_backend import StubState, build_stub

TEXT = "the quick brown fox jumps over the lazy dog"


def trained(directory: Path, corpus: str, vocab: int) -> Path:
    """A model directory holding a BPE tokenizer trained on ``corpus`` (two corpora: two vocabularies)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus] * 20, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ messages[0].content }}"})
    )
    return directory


def serving(name: str, root: Path | str | None, url: str = "http://r0:8000") -> Replica:
    replica = Replica(url)
    replica.listing = AdapterListing(name, None if root is None else str(root))
    return replica


def encoded(directory: Path) -> list[int]:
    """``TEXT`` as the tokenizer in ``directory`` encodes it."""
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(TEXT).ids


def ids(tokenizers: Tokenizers, base: str) -> list[int]:
    tokens = tokenizers.for_base(base)
    assert tokens is not None, f"no tokenizer for {base}"
    completion = tokens.completion({"prompt": TEXT})
    assert not isinstance(completion, Unrendered), completion
    return list(completion)


async def test_each_base_gets_its_own_tokenizer_from_its_dirs_entry_or_its_listed_root(
    tmp_path: Path,
) -> None:
    """Two bases in one pool: one found through ``base_model_dirs``, the other in the root its replica
    lists; each base's prompts are keyed by its own tokenizer (the same text, other tokens), and a base
    identity ``name=root`` finds its name's."""
    llama = trained(tmp_path / "llama", TEXT, 300)
    qwen = trained(tmp_path / "qwen", "pack my box with five dozen liquor jugs", 270)
    tokenizers = Tokenizers.at_start("llama", None, {"llama": llama})
    await tokenizers.learn([serving("llama", "/not/here"), serving("qwen", qwen, "http://r1:8000")])
    assert ids(tokenizers, "llama") == encoded(llama)
    assert ids(tokenizers, "qwen") == encoded(qwen)
    assert ids(tokenizers, "qwen") != ids(tokenizers, "llama")
    assert ids(tokenizers, f"qwen={qwen}") == ids(tokenizers, "qwen")
    assert tokenizers.health() == {"llama": f"from {llama}", "qwen": f"from {qwen}"}
    assert tokenizers.problem("llama") is None
    assert tokenizers.problem(None) is None


async def test_the_tokenizer_setting_wins_and_one_that_cannot_be_read_stops_the_start(tmp_path: Path) -> None:
    chosen = trained(tmp_path / "chosen", TEXT, 300)
    other = trained(tmp_path / "other", "pack my box with five dozen liquor jugs", 270)
    tokenizers = Tokenizers.at_start("base", chosen, {"base": other})
    await tokenizers.learn([serving("base", other)])
    assert tokenizers.origin == {"base": SETTING}
    assert ids(tokenizers, "base") == encoded(chosen)
    with pytest.raises(Exception, match=r"No such file|os error"):  # the tokenizers library's own error
        Tokenizers.at_start("base", tmp_path / "missing", {})


async def test_a_base_without_a_readable_tokenizer_falls_back_visibly_and_is_looked_for_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No directory to read, then a root without ``tokenizer.json``: no tokenizer, said once per place
    tried (a warning naming the base and why), not tried again in the same place; a new root (the
    replica restarted from another directory) is tried, and there it is found."""
    tokenizers = Tokenizers.at_start("base", None, {})
    with caplog.at_level(logging.WARNING, logger="gateway.kv.tokenizers"):
        await tokenizers.learn([serving("base", None)])
        problem = tokenizers.problem("base")
        assert str(problem).startswith("no tokenizer for base base: kvgate cannot read")
        empty = tmp_path / "empty"
        empty.mkdir()
        await tokenizers.learn([serving("base", empty)])
        await tokenizers.learn([serving("base", empty)])  # the same place: not read again, nor said again
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert all("routed on the predicted index" in line for line in said), said
    assert f"no tokenizer for base base: {empty} has no readable tokenizer" in str(tokenizers.problem("base"))
    assert tokenizers.for_base("base") is None
    assert tokenizers.health()["base"].startswith("none: ")
    shutil.copytree(trained(tmp_path / "model", TEXT, 300), empty, dirs_exist_ok=True)
    await tokenizers.learn([serving("base", empty)])
    assert tokenizers.for_base("base") is None, "the same root is not read again by itself"
    await tokenizers.learn([serving("base", tmp_path / "model")])
    assert tokenizers.for_base("base") is not None
    assert tokenizers.problem("base") is None


async def test_default_settings_find_the_listed_roots_tokenizer_and_healthz_shows_each_replicas_trust(
    redis: Redis, tmp_path: Path
) -> None:
    """kvgate with no routing setting in front of two stub replicas: one lists a root kvgate can read
    (its tokenizer is found there), the other another base whose root it cannot; neither publishes KV
    events. /healthz's detail view shows where each base's tokenizer came from, or why there is none,
    and each replica's routing trust with its reason."""
    model = trained(tmp_path / "model", TEXT, 300)
    readable, unreadable = StubState(), StubState()
    readable.base_root, unreadable.base, unreadable.base_root = str(model), "other", "/models/elsewhere"
    async with running(build_stub(readable)) as first, running(build_stub(unreadable)) as second:
        settings = Settings(
            replicas=[first, second], store=tmp_path / "store", data_dir=tmp_path, admin_token="admin",
            poll_interval=0.1, reconcile_interval=0.1,
        )  # fmt: skip
        async with running(build_app(settings, redis)) as url, aiohttp.ClientSession() as http:

            async def health() -> dict[str, Any]:
                async with http.get(f"{url}/healthz", headers={"x-kvgate-admin-token": "admin"}) as answer:
                    doc: dict[str, Any] = await answer.json()
                    return doc

            async def both_bases() -> bool:
                return len((await health())["tokenizers"]) == 2

            await eventually(both_bases, "both bases looked for")
            doc = await health()
            assert doc["tokenizers"]["base"] == f"from {model}"
            assert doc["tokenizers"]["other"].startswith("none: /models/elsewhere has no readable tokenizer")
            streams = doc["kv_events"]
            assert {s["routing"] for s in streams.values()} == {"predicted"}  # no events anywhere
            reasons = {s.get("routing_reason", s.get("reason")) for s in streams.values()}
            assert any(str(r).startswith("no tokenizer for base other") for r in reasons), reasons


def said(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.name == "gateway.kv.trust" for r in caplog.records)


@pytest.mark.parametrize("shared", [True, False])
async def test_a_kvgate_sharing_redis_says_once_at_start_which_replicas_are_routed_on_a_prediction(
    redis: Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture, shared: bool
) -> None:
    """A kvgate beside others on one Redis (``redis_url``) routing a replica that publishes no KV events
    says so in one WARNING, with the replica and why; alone (one process, its own Redis) it says nothing:
    its predicted index is the only one."""
    model = trained(tmp_path / "model", TEXT, 300)
    state = StubState()
    state.base_root = str(model)
    async with running(build_stub(state)) as stub:
        settings = Settings(
            replicas=[stub], store=tmp_path / "store", data_dir=tmp_path, poll_interval=0.1,
            reconcile_interval=0.1, redis_url="redis://127.0.0.1:1" if shared else None,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="gateway.kv.trust"):
            async with running(build_app(settings, redis)):
                if shared:  # alone, nothing is announced at all (no task waits to say it)
                    await eventually(lambda: said(caplog), "the start line")
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.kv.trust"]
    if not shared:
        assert lines == []
        return
    assert len(lines) == 1, lines
    assert lines[0].startswith("1 of 1 replicas routed on the predicted index, which the kvgates sharing its")
    assert f"{replica_id(stub)}: {stub} publishes no KV events" in lines[0], lines[0]
