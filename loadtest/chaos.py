"""The chaos run (issue 9 #7, issue 28 #8): every feature at once. kvgate processes (``--workers 2``
each, default routing: precise on KV events) on one Redis in front of two real vLLM CPU replicas that
publish KV events, adapters in an object store (moto's S3 server) fetched by one ``kvgate agent`` per
replica, four tenants, concurrent traffic, versions and rollouts changing, and faults, for ``--requests``
requests. Does every answer stay coherent? The exit status is 1 when one did not (or a fault kind never
ran, or nothing was judged).

Topology: one ``redis-server`` this run owns (TCP on 127.0.0.1, append-only file fsynced always), two
vLLM replicas (``gateway.dev.vllm_process``, ``kv_events_args``), a moto S3 server and a bucket, one
``kvgate agent`` per replica (its own directory, which the replica loads from), ``--kvgates`` ``kvgate
serve`` processes (``--expose-replica-urls``, so an answer names the replica by URL and can be recomputed
there), four logical IDs published with ``kvgate publish`` to the bucket. Concurrent clients send
completions and chat completions, streaming and not, to a random kvgate (a connection refused by a killed
kvgate goes to the next one, as a load balancer would). Meanwhile:

- changes: publishes (cycling through the fixture's adapter versions), rollbacks and bumps with the CLI,
  bumps straight through Redis (``kvgate script bump_epoch`` text, by ``EVAL`` and by ``redis-cli --eval``),
  rollouts (``kvgate rollout`` start and raise, ``kvgate promote``, ``kvgate abort``), chosen by what the
  tenant's state allows; after each version or epoch change, every live kvgate's ``/kvgate/status`` is
  polled until its snapshot shows it (the delay is measured from the ``updated_ms`` the script wrote);
- faults, spread over the requests, each kind at least once: ``kill -9`` of one worker of a kvgate (its
  parent starts another), ``kill -9`` of a whole kvgate (restarted 2 s later), a vLLM replica stopped and
  started again (it comes back with no adapters), Redis killed (``kill -9``) and restarted from its
  append-only file, and once restarted empty (kvgates re-seed from their snapshots).

Every response's version, digest, epoch and replica is recorded (``records.jsonl`` in the work folder,
``changes.jsonl`` beside it). One in ``--sample-every`` complete answers is recomputed at once, cold, on
the replica that served it, straight to the replica (same versioned name and request, a fresh
``cache_salt``): the tokens must be equal and max |dlogprob| within the tolerance, calibrated the audit's
way over the whole run (``judge``: a margin times the largest disagreement between cold runs). A version
unloaded meanwhile is loaded again from that replica's agent's copy first.

    .venv/bin/python -m loadtest.chaos --vllm-python .venv-vllm/bin/python --fixture-dir .cache/fixture \\
        --requests 10000 --out docs/chaos.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from gateway.core.errors import LoadFailed
from gateway.core.identity import scan_adapter, tree_digest
from gateway.core.wire import (
    ADMIN_TOKEN_HEADER,
    DIGEST_HEADER,
    EPOCH_HEADER,
    PREFIX_MATCH_HEADER,
    REPLICA_HEADER,
    ROLE_HEADER,
    VERSION_HEADER,
    cold_salt,
)
from gateway.dev import generated_docs
from gateway.dev.vllm_process import VllmProcess, VllmReplicaSpec, kv_events_args, start_replicas
from gateway.fleet.backends.vllm import VllmDialect
from gateway.process.http_edge import free_port
from gateway.proof.audit import TOLERANCE_MARGIN
from gateway.table import keys
from gateway.table.epoch_table import REDIS_DOWN
from loadtest.invalidation import system_prompt
from tests.support.s3_server import s3_server

log = logging.getLogger("chaos")

TOKEN = "chaos-admin-token"
AGENT_TOKEN = "chaos-agent-token"
READY_S = 180.0  # a (re)started kvgate takes its base prints and starts its workers within this
DEADLINE_S = 120.0  # a request still running after this is hung
QUESTIONS = 24  # few enough that prompts repeat: warm hits, and cold answers to compare across replicas
PROPAGATION_DEADLINE_S = 15.0
POLL_S = 0.01  # between two polls of one kvgate's status, while waiting for a change to show
EPSILON = 1e-6  # float noise allowed on top of the tolerance (logprobs travel as JSON floats)
DRAIN_GRACE_S = 2.0  # kvgate's --drain-grace: a retired version may be unloaded this long after
CALIBRATE_EVERY = 4  # every 4th check runs three cold runs, whatever it finds (the cold-to-cold spread)
TOP_LOGPROBS = 5  # a cold run's top tokens per position: is the answer's token, where they part, a near-tie?


# --- child processes ---------------------------------------------------------------------------------


class Child:
    """A process in its own session (process group), its output appended to a log file."""

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    async def kill(self) -> None:
        """``kill -9`` the whole group and reap it."""
        await self._end(signal.SIGKILL, 10.0)

    async def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; safe to call on a dead or never started child."""
        await self._end(signal.SIGTERM, grace)
        await self._end(signal.SIGKILL, 10.0)

    async def _end(self, sig: signal.Signals, grace: float) -> None:
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), grace)
        if self._log is not None and (proc is None or proc.returncode is not None):
            self._log.close()
            self._log = None


async def until(
    check: Callable[[], Awaitable[bool]], deadline_s: float, what: str, step: float = 0.1
) -> None:
    """Poll ``check`` until it is true; ``TimeoutError`` naming ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f} s")
        await asyncio.sleep(step)


class RedisServer:
    """A real ``redis-server`` on a TCP port of its own, persisting to an append-only file (fsync always,
    so a ``kill -9`` loses nothing); ``wipe`` deletes its data so the next start is empty."""

    def __init__(self, directory: Path, port: int) -> None:
        self.dir = directory
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self.child: Child | None = None

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", ""]  # fmt: skip
        self.child = Child(argv, self.dir.parent / "redis.log")
        await self.child.spawn()

        async def answers() -> bool:
            if self.child is None or not self.child.running:
                raise RuntimeError(f"redis-server exited; see {self.dir.parent / 'redis.log'}")
            client = Redis(port=self.port, socket_connect_timeout=1)
            try:
                return bool(await client.ping())
            except REDIS_DOWN:
                return False
            finally:
                await client.aclose()

        await until(answers, 30, "redis-server answers")

    async def kill(self) -> None:
        if self.child is not None:
            await self.child.kill()

    def wipe(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    async def stop(self) -> None:
        if self.child is not None:
            await self.child.stop()


def kvgate_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


def worker_pids(parent: int) -> list[int]:
    """The ``gateway.process.worker`` children of the process ``parent`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # it ended meanwhile
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"gateway.process.worker" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


class Kvgate:
    """One ``kvgate serve`` (a parent and its workers); started again on the same port after a kill."""

    def __init__(self, index: int, argv: list[str], port: int, log_path: Path) -> None:
        self.index = index
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = argv
        self.log_path = log_path
        self.env = dict(os.environ, KVGATE_ADMIN_TOKEN=TOKEN)
        self.child: Child | None = None
        self.up = False

    async def start(self, http: aiohttp.ClientSession) -> None:
        self.child = Child(self.argv, self.log_path, self.env)
        await self.child.spawn()

        async def healthy() -> bool:
            if self.child is None or not self.child.running:
                raise RuntimeError(f"kvgate {self.index} exited; see {self.log_path}")
            try:
                async with http.get(f"{self.url}/healthz") as response:
                    return response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        await until(healthy, READY_S, f"kvgate {self.index} healthy")
        self.up = True

    def workers(self) -> list[int]:
        """The process ids of its workers (``gateway.process.worker`` children of its parent), from /proc."""
        if self.child is None or self.child.proc is None or not self.child.running:
            return []
        return worker_pids(self.child.proc.pid)

    async def healthy(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(f"{self.url}/healthz") as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def kill9(self) -> None:
        self.up = False
        if self.child is not None:
            await self.child.kill()

    async def stop(self) -> None:
        self.up = False
        if self.child is not None:
            await self.child.stop()

    async def status(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.get(f"{self.url}/kvgate/status", headers={ADMIN_TOKEN_HEADER: TOKEN}) as response:
            response.raise_for_status()
            doc: dict[str, Any] = await response.json()
            return doc


# --- requests and what they answered ---------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    chat: bool
    stream: bool
    max_tokens: int
    weight: float


SHAPES = (
    Shape("completion", chat=False, stream=False, max_tokens=8, weight=0.30),
    Shape("completion-stream", chat=False, stream=True, max_tokens=8, weight=0.20),
    Shape("completion-stream-long", chat=False, stream=True, max_tokens=32, weight=0.15),
    Shape("chat", chat=True, stream=False, max_tokens=8, weight=0.15),
    Shape("chat-stream", chat=True, stream=True, max_tokens=16, weight=0.20),
)


def request_body(shape: Shape, tenant: int, question: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": f"tenant-{tenant}", "max_tokens": shape.max_tokens, "temperature": 0}
    ask = f"Question {question}: what comes next, and why?"
    if shape.chat:
        body["messages"] = [
            {"role": "system", "content": system_prompt(tenant)},
            {"role": "user", "content": ask},
        ]
        body["logprobs"] = True
    else:
        body["prompt"] = f"{system_prompt(tenant)} {ask}"
        body["logprobs"] = 1
    if shape.stream:
        body["stream"] = True
    return body


def top_choices(choice: dict[str, Any], chat: bool) -> list[dict[str, float]]:
    """Per generated position, the top tokens and their logprobs (a cold run asks for ``TOP_LOGPROBS``)."""
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [
            {str(t["token"]): float(t["logprob"]) for t in item.get("top_logprobs") or []}
            for item in logprobs.get("content") or []
        ]
    return [
        {str(k): float(v) for k, v in (item or {}).items()} for item in logprobs.get("top_logprobs") or []
    ]


def choice_parts(choice: dict[str, Any], chat: bool, stream: bool) -> tuple[str, list[str], list[float]]:
    """The text, tokens and token logprobs one choice (or SSE chunk choice) carries."""
    logprobs = choice.get("logprobs") or {}
    if chat:
        message = (choice.get("delta") if stream else choice.get("message")) or {}
        content = logprobs.get("content") or []
        return (
            str(message.get("content") or ""),
            [str(t["token"]) for t in content],
            [float(t["logprob"]) for t in content],
        )
    return (
        str(choice.get("text") or ""),
        [str(t) for t in logprobs.get("tokens") or []],
        [float(x) for x in logprobs.get("token_logprobs") or []],
    )


@dataclass
class Outcome:
    """One request through kvgate, and what became of it."""

    started: float  # wall clock (s)
    ended: float
    gateway: int
    tenant: str
    shape: str
    question: int
    status: int | None = None
    error: str | None = None  # its kind: "HTTP 503 service_unavailable", "disconnected", ...
    detail: str = ""
    version: str | None = None
    digest: str | None = None
    epoch: int | None = None
    replica: str | None = None
    role: str | None = None  # while a rollout runs: current | candidate (x-kvgate-rollout)
    match: str | None = None  # what the routing decision matched (x-kvgate-prefix-match: "precise:3")
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # a finish_reason arrived (and [DONE], when streaming)
    cut: str | None = None  # a stream that began and did not finish: why
    model_leaks: int = 0  # bodies or chunks whose model was not the logical ID
    check: str = "unsampled"  # coherent | incoherent | nondeterministic | not-recomputable: REASON
    colds: int = 0  # cold runs made for the check
    diffs: list[float] = field(default_factory=list)  # max |dlogprob| to each cold run (inf: other tokens)
    cold_spread: float | None = None  # max |dlogprob| between its cold runs that have the same tokens
    colds_agree: bool = True  # its cold runs all have the same tokens
    diverges_at: int | None = None  # first token where the answer and the first cold run differ
    prefix_diff: float | None = None  # max |dlogprob| on the tokens before that
    tie_gap: float | None = None  # how near a tie that first difference is (``Answer.tie_gap``), if one
    verdict: str = ""  # set by the report: coherent | incoherent | nondeterministic

    @property
    def max_diff(self) -> float:
        """Max |dlogprob| to the closest cold run."""
        return min(self.diffs, default=math.inf)

    self_loaded: bool = False  # the version was gone from the replica: this run loaded it again
    checked_at: float | None = None  # wall clock (s) when its cold runs were done

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finished and self.cut is None and self.error is None


async def send(
    http: aiohttp.ClientSession, url: str, shape: Shape, body: dict[str, Any], out: Outcome
) -> None:
    """POST through kvgate; fills ``out``. Raises ``aiohttp.ClientConnectorError`` when nothing was sent."""
    path = "/v1/chat/completions" if shape.chat else "/v1/completions"
    async with http.post(url + path, json=body) as response:
        out.status = response.status
        out.version = response.headers.get(VERSION_HEADER)
        out.digest = response.headers.get(DIGEST_HEADER)
        epoch = response.headers.get(EPOCH_HEADER)
        out.epoch = int(epoch) if epoch else None
        out.replica = response.headers.get(REPLICA_HEADER)
        out.role = response.headers.get(ROLE_HEADER)
        out.match = response.headers.get(PREFIX_MATCH_HEADER)
        if response.status != 200:
            text = await response.text()
            out.error, out.detail = error_kind(response.status, text)
            return
        if not shape.stream:
            doc = await response.json(content_type=None)
            out.model_leaks += doc.get("model") != body["model"]
            choice = doc["choices"][0]
            out.text, out.tokens, out.logprobs = choice_parts(choice, shape.chat, stream=False)
            out.finished = choice.get("finish_reason") is not None
            return
        finish, done = False, False
        try:
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    continue
                doc = json.loads(payload)
                if "error" in doc:
                    out.cut = f"error event: {doc['error'].get('message', '')[:200]}"
                    continue
                out.model_leaks += doc.get("model") != body["model"]
                for choice in doc.get("choices") or []:
                    text, tokens, logprobs = choice_parts(choice, shape.chat, stream=True)
                    out.text += text
                    out.tokens += tokens
                    out.logprobs += logprobs
                    finish = finish or choice.get("finish_reason") is not None
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            out.cut = f"connection broke: {type(exc).__name__}"
        out.finished = finish and done
        if out.cut is None and not out.finished:
            out.cut = "ended without finish_reason and [DONE]"


def error_kind(status: int, text: str) -> tuple[str, str]:
    """``HTTP <status> <error type>`` and the message, from an OpenAI-style error body."""
    try:
        error = json.loads(text).get("error") or {}
        kind, message = str(error.get("type") or "?"), str(error.get("message") or "")
    except (ValueError, AttributeError):
        kind, message = "not-json", text
    return f"HTTP {status} {kind}", message[:300]


# --- the cold recomputation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    tops: tuple[dict[str, float], ...] = ()  # per position, the top tokens' logprobs (cold runs)

    def tie_gap(self, cold: Answer) -> float | None:
        """Where this answer first parts from ``cold``: how near a tie that is. The largest of: max |dlogprob|
        on the tokens before, how far below the cold run's own choice it rates this answer's token, and
        |dlogprob| of this answer's token between the two. Numerical noise within the tolerance flips such a
        near-tie (the continuations then differ, having other contexts); a version mix-up parts at once, by
        far. None when they do not part, or the cold run does not rate this answer's token."""
        at, before = self.divergence(cold)
        if at is None or at >= min(len(self.tokens), len(self.logprobs), len(cold.tops), len(cold.logprobs)):
            return None
        rated = cold.tops[at].get(self.tokens[at])
        if rated is None:
            return None
        return max(before, cold.logprobs[at] - rated, abs(self.logprobs[at] - rated))

    def diff(self, other: Answer) -> float:
        """Max |dlogprob| over the tokens; infinite when the token sequences differ."""
        if self.tokens != other.tokens or len(self.logprobs) != len(other.logprobs):
            return math.inf
        return max((abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True)), default=0.0)

    def agrees(self, other: Answer, tolerance: float) -> bool:
        return self.text == other.text and self.diff(other) <= tolerance + EPSILON

    def divergence(self, other: Answer) -> tuple[int | None, float]:
        """The first token where the two differ (None: nowhere), and max |dlogprob| on the tokens before."""
        at = next(
            (i for i, (a, b) in enumerate(zip(self.tokens, other.tokens, strict=False)) if a != b), None
        )
        if at is None and len(self.tokens) != len(other.tokens):
            at = min(len(self.tokens), len(other.tokens))
        end = len(self.logprobs) if at is None else at
        pairs = zip(self.logprobs[:end], other.logprobs[:end], strict=False)
        return at, max((abs(a - b) for a, b in pairs), default=0.0)


class Checker:
    """Recomputes answers cold on the replica that served them, straight to the replica; the verdicts are
    drawn at the end of the run (``judge``), once the cold-to-cold noise of the whole run is known."""

    def __init__(self, http: aiohttp.ClientSession, copy_of: Callable[[str, str], Path]) -> None:
        self.http = http
        self.copy_of = copy_of
        """(replica URL, digest) -> the directory that replica loads that version from (its agent's copy)."""
        self.dialect = VllmDialect()
        self.checked = 0
        self.references: dict[tuple[str, str], tuple[str, Answer]] = {}
        """(digest, request) -> (replica, cold answer): the same version should answer alike everywhere."""
        self.replica_differences: list[tuple[str, int | None, float, float]] = []
        """(what, first differing token, max |dlogprob| before it, max |dlogprob|) where the two replicas'
        cold answers to the same request for the same version differ at all."""
        self.calibration_failures: Counter[str] = Counter()

    async def cold(self, out: Outcome, shape: Shape, body: dict[str, Any]) -> Answer | str:
        """A cold answer on the replica that served ``out``, or why there is none. A version unloaded
        meanwhile (404) is loaded again from the copy its agent keeps first."""
        assert out.replica is not None
        assert out.version is not None
        assert out.digest is not None
        cold_body = {k: v for k, v in body.items() if k != "stream"} | {"model": out.version}
        cold_body |= {"top_logprobs": TOP_LOGPROBS} if shape.chat else {"logprobs": TOP_LOGPROBS}
        path = "/v1/chat/completions" if shape.chat else "/v1/completions"
        try:
            for attempt in range(2):
                cold_body["cache_salt"] = cold_salt()
                async with self.http.post(out.replica + path, json=cold_body) as response:
                    text = await response.text()
                if response.status == 404 and attempt == 0:
                    copy = self.copy_of(out.replica, out.digest)
                    if not copy.is_dir():
                        return "gone from the replica and from its agent's directory"
                    out.self_loaded = True
                    await self.dialect.load(self.http, out.replica, out.version, str(copy))
                    continue
                if response.status != 200:
                    return f"{response.status}: {text[:200]}"
                choice = json.loads(text)["choices"][0]
                answer, tokens, logprobs = choice_parts(choice, shape.chat, stream=False)
                return Answer(answer, tuple(tokens), tuple(logprobs), tuple(top_choices(choice, shape.chat)))
        except (aiohttp.ClientError, TimeoutError, LoadFailed, ValueError, KeyError) as exc:
            return f"{type(exc).__name__}: {str(exc)[:160]}"
        return "404 after loading it again"

    async def check(self, out: Outcome, shape: Shape, body: dict[str, Any]) -> None:
        """One cold run; two more when it differs from the answer at all, and for every
        ``CALIBRATE_EVERY``-th check (the cold-to-cold spread calibrates the tolerance)."""
        self.checked += 1
        served = Answer(out.text, tuple(out.tokens), tuple(out.logprobs))
        first = await self.cold(out, shape, body)
        if isinstance(first, str):
            out.check = f"not-recomputable: {first[:60]}"
            return
        colds = [first]
        if not served.agrees(first, 0.0) or self.checked % CALIBRATE_EVERY == 0:
            for _ in range(2):
                again = await self.cold(out, shape, body)
                if isinstance(again, str):
                    self.calibration_failures[again[:60]] += 1
                else:
                    colds.append(again)
        out.check = "checked"
        out.colds = len(colds)
        out.diffs = [served.diff(c) for c in colds]
        spreads = [a.diff(b) for i, a in enumerate(colds) for b in colds[i + 1 :] if a.tokens == b.tokens]
        out.cold_spread = max(spreads) if spreads else None
        out.colds_agree = len({c.tokens for c in colds}) == 1
        out.diverges_at, out.prefix_diff = served.divergence(first)
        out.tie_gap = served.tie_gap(first)
        key = (str(out.digest), json.dumps(body | {"model": out.version}, sort_keys=True))
        seen = self.references.setdefault(key, (str(out.replica), first))
        if seen[0] != out.replica and not seen[1].agrees(first, 0.0):
            at, before = seen[1].divergence(first)
            what = f"{out.version} on {out.replica} and {seen[0]}"
            self.replica_differences.append((what, at, before, seen[1].diff(first)))


def judge(outcomes: Sequence[Outcome]) -> float:
    """Verdicts for every checked answer; returns the tolerance. The audit's rule, over the whole run: the
    tolerance is ``TOLERANCE_MARGIN`` times the largest |dlogprob| seen between two cold runs of the same
    request (same tokens) on the same replica. An answer is coherent when it has the tokens of one of its
    cold runs and max |dlogprob| to it within the tolerance; nondeterministic when it is not and its cold
    runs disagree on the tokens among themselves (nothing can be judged); a tie when it parts from its
    agreeing cold runs at a near-tie (``Answer.tie_gap`` within the tolerance: the same numerical noise the
    tolerance allows flips it); incoherent otherwise."""
    spreads = [o.cold_spread for o in outcomes if o.cold_spread is not None]
    tolerance = TOLERANCE_MARGIN * max(spreads, default=0.0)
    for out in outcomes:
        if out.check != "checked":
            continue
        if out.max_diff <= tolerance + EPSILON:
            out.verdict = "coherent"
        elif not out.colds_agree:
            out.verdict = "nondeterministic"
        elif out.tie_gap is not None and out.tie_gap <= tolerance + EPSILON:
            out.verdict = "tie"
        else:
            out.verdict = "incoherent"
    return tolerance


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    ended: float | None = None
    note: str = ""


@dataclass
class Change:
    op: str
    tenant: str
    started: float  # wall clock (s) when the change was begun
    at: float  # and when its propagation was measured
    epoch: int
    digest: str
    propagation: Propagation


@dataclass(frozen=True)
class Propagation:
    """Milliseconds from a change to the last live kvgate showing it (None: not within the deadline)."""

    sent_ms: float | None  # the poll that first showed it was sent then (an estimate)
    answered_ms: float | None  # and answered then (an upper bound)
    gateways: int  # how many kvgates were measured


FAULT_KINDS = ("kill-worker", "kill-kvgate", "restart-vllm", "restart-redis-aof", "restart-redis-empty")
BUMPS = (("bump-cli", 0.15), ("bump-eval", 0.20), ("bump-redis-cli", 0.05))
CHANGE_OPS = (  # (op, weight) while no rollout runs for the tenant
    ("publish", 0.25),
    ("rollback", 0.10),
    ("rollout-start", 0.25),
    *BUMPS,
)
ROLLOUT_OPS = (  # and while one runs (a publish or a rollback would be refused then)
    ("rollout-raise", 0.30),
    ("promote", 0.20),
    ("abort", 0.10),
    *BUMPS,
)


def fault_plan(requests: int) -> list[str]:
    """The faults of a run of ``requests`` requests, in order: every kind once, more in a long run."""
    plan = ["kill-worker", "kill-kvgate", "restart-vllm", "restart-redis-aof", "kill-worker"]
    plan += ["restart-redis-empty"]
    if requests >= 5000:
        plan += ["kill-kvgate", "restart-redis-aof", "kill-worker", "restart-vllm", "kill-kvgate"]
    return plan


def fault_points(plan: Sequence[str], requests: int) -> list[int]:
    """After how many requests sent each fault of ``plan`` begins: spread from 5% to 90% of the run."""
    last = max(1, len(plan) - 1)
    return [int(requests * (0.05 + 0.85 * k / last)) for k in range(len(plan))]


def next_op(rng: random.Random, rollout_running: bool) -> str:
    """The next change for a tenant, among those its state allows."""
    ops = ROLLOUT_OPS if rollout_running else CHANGE_OPS
    return rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.store = ""  # s3://BUCKET/chaos, once the S3 server runs
        self.agent_dirs = [work / f"agent-{i}" for i in (0, 1)]  # each replica's agent keeps versions here
        self.agents: list[Child] = []
        self.redis_server = RedisServer(work / "redis", free_port())
        self.redis = Redis.from_url(self.redis_server.url, socket_timeout=5, socket_connect_timeout=2)
        self.replicas: list[VllmProcess] = []
        self.gateways: list[Kvgate] = []
        self.http: aiohttp.ClientSession | None = None
        self.checker: Checker | None = None
        self.redis_up = asyncio.Event()
        self.stop = asyncio.Event()
        self.outcomes: list[Outcome] = []
        self.refused_retried = 0  # connections refused by a killed kvgate, sent to the next one
        self.changes: list[Change] = []
        self.ops_done: Counter[str] = Counter()  # every change command that succeeded, by kind
        self.change_failures: Counter[str] = Counter()
        self.faults: list[Fault] = []
        self.reseed_s: list[float] = []
        self.metrics: dict[str, Counter[str]] = {}
        self.versions = {
            name: tree_digest(path, scan_adapter(path))
            for name, path in ((p.name, p) for p in sorted((args.fixture_dir / "adapters").iterdir()))
        }
        self.records = (work / "records.jsonl").open("w", buffering=1)
        self._sent = 0
        self.issued = 0  # requests begun
        self.enough = asyncio.Event()  # set once --requests requests were begun
        self.fault_at = math.inf  # the next fault begins once this many requests were begun
        self.fault_due = asyncio.Event()
        self.status_rtt_ms: list[float] = []
        self.exiting: set[asyncio.Task[tuple[bytes, bytes]]] = set()  # CLI processes that answered
        self.listing_rtt_ms: list[float] = []
        self.bump_script = ""
        self.t0 = self.t1 = 0.0

    # --- setup ---

    def adapter_dir(self, version: str) -> Path:
        return Path(self.args.fixture_dir) / "adapters" / version

    async def kvgate(self, *args: str) -> dict[str, Any]:
        """A kvgate CLI command against this run's Redis and store: its ``--json`` answer, returned as
        soon as it is printed (right after the change), while the process may still be exiting."""
        argv = kvgate_cli(*args, "--json", "--redis-url", self.redis_server.url, "--store", self.store)
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert process.stdout is not None
        printed = b""
        async with asyncio.timeout(120):
            while chunk := await process.stdout.read(65536):
                printed += chunk
                with contextlib.suppress(ValueError):
                    doc: dict[str, Any] = json.loads(printed)
                    self.exiting.add(asyncio.create_task(process.communicate()))
                    return doc
            _, err = await process.communicate()
        lines = err.decode().strip().splitlines() or ["(no output)"]
        raise ChangeFailed(lines[-1][:200])

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        self.http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        )
        self.checker = Checker(self.http, self.copy_of)
        s3 = stack.enter_context(s3_server(self.work / "s3.log"))
        os.environ.update(s3.environment())  # every CLI command, agent and kvgate reads the store's AWS_*
        self.store = f"s3://{s3.new_bucket()}/chaos"
        stack.push_async_callback(self.redis.aclose)
        stack.push_async_callback(self.redis_server.stop)
        await self.redis_server.start()
        self.redis_up.set()
        specs = [
            VllmReplicaSpec(self.args.vllm_python, self.args.fixture_dir / "model", free_port(),
                            self.work / f"vllm-{i}.log", max_loras=8, max_cpu_loras=16,
                            threads=self.args.vllm_threads, extra_args=kv_events_args())
            for i in (0, 1)
        ]  # fmt: skip
        print(
            f"starting redis-server, an S3 server, two vLLM replicas with their agents and "
            f"{self.args.kvgates} kvgates x {self.args.workers} workers (work folder {self.work}) ..."
        )
        stack.push_async_callback(self._stop_replicas)
        self.replicas = await start_replicas(specs)
        stack.push_async_callback(self._stop_agents)
        agent_urls = [await self.start_agent(i, replica.url) for i, replica in enumerate(self.replicas)]
        versions = sorted(self.versions)
        for i in range(self.args.tenants):
            await self.kvgate("publish", f"tenant-{i}", str(self.adapter_dir(versions[i % len(versions)])))
        script = await asyncio.create_subprocess_exec(
            *kvgate_cli("script", "bump_epoch"), stdout=asyncio.subprocess.PIPE
        )
        self.bump_script = (await script.communicate())[0].decode()
        (self.work / "bump_epoch.lua").write_text(self.bump_script)
        stack.push_async_callback(self._stop_gateways)
        agents = [
            f"{r.url}={url}|{d}" for r, url, d in zip(self.replicas, agent_urls, self.agent_dirs, strict=True)
        ]
        for i in range(self.args.kvgates):
            argv = kvgate_cli(
                "serve", *(a for r in self.replicas for a in ("--replica", r.url)),
                *(a for agent in agents for a in ("--replica-agents", agent)),
                "--agent-token", AGENT_TOKEN,
                "--redis-url", self.redis_server.url, "--store", self.store,
                "--data-dir", str(self.work / f"kvgate-{i}"), "--port", str(free_port()),
                "--drain-grace", str(DRAIN_GRACE_S), "--lease-ttl", "3", "--shutdown-timeout", "5",
                "--expose-replica-urls", "--workers", str(self.args.workers),
                "--max-adapters-per-replica", str(self.args.budget),
                "--canary-interval", str(self.args.canary_interval),
            )  # fmt: skip
            port = int(argv[argv.index("--port") + 1])
            self.gateways.append(Kvgate(i, argv, port, self.work / f"kvgate-{i}.log"))
        await asyncio.gather(*(g.start(self.http) for g in self.gateways))
        for i in range(self.args.tenants):
            state = await self.state(f"tenant-{i}")
            assert state is not None
            await self.propagation(f"tenant-{i}", state[0], state[1], state[2])

    async def start_agent(self, index: int, replica_url: str) -> str:
        """``kvgate agent`` for one replica, keeping versions in its own directory (which the replica, on
        this machine, reads at the same path); its URL once it answers."""
        assert self.http is not None
        http = self.http
        port, directory = free_port(), self.agent_dirs[index]
        argv = kvgate_cli(
            "agent", "--store", self.store, "--agent-dir", str(directory), "--agent-root", str(directory),
            "--agent-replica", replica_url, "--agent-port", str(port), "--agent-token", AGENT_TOKEN,
        )  # fmt: skip
        child = Child(argv, self.work / f"agent-{index}.log")
        self.agents.append(child)
        await child.spawn()
        url = f"http://127.0.0.1:{port}"

        async def answers() -> bool:
            if not child.running:
                raise RuntimeError(f"kvgate agent {index} exited; see {child.log_path}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/healthz") as response:
                    return response.status == 200
            return False

        await until(answers, 60, f"kvgate agent {index} answers")
        return url

    def copy_of(self, replica_url: str, digest: str) -> Path:
        """The directory a replica loads a version from: its agent's copy."""
        index = next(i for i, r in enumerate(self.replicas) if r.url == replica_url)
        return self.agent_dirs[index] / digest

    async def _stop_agents(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.agents), return_exceptions=True)

    async def _stop_replicas(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)

    async def _stop_gateways(self) -> None:
        await asyncio.gather(*(g.stop() for g in self.gateways), return_exceptions=True)

    # --- traffic ---

    async def traffic(self, worker: int) -> None:
        assert self.http is not None
        assert self.checker is not None
        while not self.stop.is_set():
            shape = self.rng.choices(SHAPES, weights=[s.weight for s in SHAPES])[0]
            tenant, question = self.rng.randrange(self.args.tenants), self.rng.randrange(QUESTIONS)
            body = request_body(shape, tenant, question)
            self.issued += 1
            if self.issued >= self.args.requests:
                self.enough.set()
            if self.issued >= self.fault_at:
                self.fault_due.set()
            out = await self.one(shape, body, question)
            if out.complete and out.version and out.replica:
                self._sent += 1
                if self._sent % self.args.sample_every == 0:
                    await self.checker.check(out, shape, body)
                    out.checked_at = time.time()
            self.outcomes.append(out)
            self.records.write(json.dumps(asdict(out)) + "\n")

    async def one(self, shape: Shape, body: dict[str, Any], question: int) -> Outcome:
        assert self.http is not None
        index = next_gateway = self.rng.randrange(len(self.gateways))
        out = Outcome(time.time(), 0.0, index, body["model"], shape.name, question)
        deadline = asyncio.timeout(DEADLINE_S)
        try:
            async with deadline:
                for attempt in range(len(self.gateways)):
                    out.gateway = next_gateway
                    try:
                        await send(self.http, self.gateways[next_gateway].url, shape, body, out)
                        break
                    except aiohttp.ClientConnectorError as exc:
                        if attempt + 1 == len(self.gateways):
                            out.error, out.detail = "connection refused by every kvgate", str(exc)
                        else:
                            self.refused_retried += 1
                            next_gateway = (next_gateway + 1) % len(self.gateways)
        except TimeoutError as exc:
            if deadline.expired():
                out.error, out.detail = "hung", f"no answer within {DEADLINE_S:.0f} s"
            else:  # aiohttp's own (a connect timeout)
                out.error, out.detail = f"client: {type(exc).__name__}", str(exc)[:300]
        except (aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
            if out.status == 200 and shape.stream:
                out.cut = f"{type(exc).__name__}"
            else:
                out.error, out.detail = f"client: {type(exc).__name__}", str(exc)[:300]
        out.ended = time.time()
        return out

    # --- changes ---

    async def state(self, tenant: str) -> tuple[int, str, int] | None:
        """(epoch, digest, updated_ms) of the tenant's current version."""
        raw = await self.redis.hmget(keys.state(tenant), ["epoch", "digest", "updated_ms"])
        epoch, digest, updated = (v.decode() if isinstance(v, bytes) else v for v in raw)
        if epoch is None or digest is None:
            return None
        return int(epoch), str(digest), int(updated or 0)

    async def candidate(self, tenant: str) -> str | None:
        """The digest of the tenant's rollout candidate, if one runs."""
        raw = await self.redis.hget(keys.state(tenant), "cand_digest")
        return raw.decode() if isinstance(raw, bytes) and raw else None

    def next_version(self, digest: str) -> Path:
        """The fixture's adapter version after the one with ``digest`` (cycling)."""
        names = sorted(self.versions)
        index = next((i for i, n in enumerate(names) if self.versions[n] == digest), -1)
        return self.adapter_dir(names[(index + 1) % len(names)])

    async def change(self) -> None:
        tenant = f"tenant-{self.rng.randrange(self.args.tenants)}"
        op = next_op(self.rng, await self.candidate(tenant) is not None)
        started = time.time()
        before = await self.state(tenant)
        if op == "publish":
            await self.kvgate("publish", tenant, str(self.next_version(before[1] if before else "")))
        elif op == "rollout-start":
            source = str(self.next_version(before[1] if before else ""))
            await self.kvgate("rollout", tenant, source, "--percent", str(self.rng.choice((10, 25, 50))))
        elif op == "rollout-raise":
            await self.kvgate("rollout", tenant, "--percent", str(self.rng.choice((50, 75, 90))))
        elif op in ("promote", "abort"):
            await self.kvgate(op, tenant)
        elif op == "rollback":
            await self.kvgate("rollback", tenant)
        elif op == "bump-cli":
            await self.kvgate("bump", tenant)
        elif op == "bump-eval":  # the text `kvgate script bump_epoch` prints, run by EVAL
            args = (tenant, time.time_ns() // 1_000_000, keys.LOG_KEPT, keys.HISTORY_KEPT)
            table_keys = (keys.state(tenant), keys.history(tenant), keys.LOG, keys.ROWS, keys.CHECK)
            await self.redis.eval(self.bump_script, 5, *table_keys, *args)
        else:  # the operator guide's exact redis-cli command
            script = str(self.work / "bump_epoch.lua")
            argv = ["redis-cli", "-p", str(self.redis_server.port), "--eval", script,
                    keys.state(tenant), keys.history(tenant), keys.LOG, keys.ROWS, keys.CHECK, ",", tenant,
                    str(time.time_ns() // 1_000_000), str(keys.LOG_KEPT), str(keys.HISTORY_KEPT)]  # fmt: skip
            process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
            out, _ = await process.communicate()
            if process.returncode != 0 or not out.startswith(b"1\n"):
                raise ChangeFailed(f"redis-cli --eval: {out.decode().strip()[:100]}")
        self.ops_done[op] += 1
        after = await self.state(tenant)
        if after is None or after[:2] == (before[:2] if before else None):
            return  # unchanged (the same version again)
        propagation = await self.propagation(tenant, *after)
        self.changes.append(Change(op, tenant, started, time.time(), after[0], after[1], propagation))
        with (self.work / "changes.jsonl").open("a") as record:
            record.write(json.dumps(asdict(self.changes[-1])) + "\n")

    async def propagation(self, tenant: str, epoch: int, digest: str, updated_ms: int) -> Propagation:
        """From the change (``updated_ms``, written by the script) until every live kvgate's snapshot
        shows it, by polling each one's ``/kvgate/status``: the poll that first shows it was sent at
        ``sent`` and answered at ``answered`` (its handler ran in between)."""
        assert self.http is not None
        http = self.http

        async def seen(gateway: Kvgate) -> tuple[float, float] | Literal["down"] | None:
            deadline = time.monotonic() + PROPAGATION_DEADLINE_S
            while time.monotonic() < deadline:
                if not gateway.up:
                    return "down"
                sent = time.time() * 1000
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    doc = (await gateway.status(http))["versions"].get(tenant) or {}
                    answered = time.time() * 1000
                    self.status_rtt_ms.append(answered - sent)
                    shown = doc.get("epoch", 0)
                    if shown > epoch or (shown == epoch and doc.get("digest") == digest):
                        return sent, answered
                await asyncio.sleep(POLL_S)
            return None

        found = [t for t in await asyncio.gather(*(seen(g) for g in self.gateways if g.up)) if t != "down"]
        if not found or any(t is None for t in found):
            return Propagation(None, None, len(found))
        times = [t for t in found if isinstance(t, tuple)]
        return Propagation(
            max(t[0] for t in times) - updated_ms, max(t[1] for t in times) - updated_ms, len(times)
        )

    async def sample_listings(self) -> None:
        """How long each replica takes to answer ``/v1/models`` (what every kvgate polls), every 2 s."""
        assert self.http is not None
        while not self.stop.is_set():
            for replica in list(self.replicas):
                started = time.monotonic()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.http.get(f"{replica.url}/v1/models") as response:
                        await response.read()
                        if response.status == 200:
                            self.listing_rtt_ms.append((time.monotonic() - started) * 1000)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 2.0)

    async def change_forever(self) -> None:
        while not self.stop.is_set():
            await self.redis_up.wait()
            try:
                await self.change()
            except ChangeFailed as exc:
                self.change_failures[exc.args[0]] += 1
            except REDIS_DOWN as exc:  # Redis went away under us
                self.change_failures[f"redis: {type(exc).__name__}"] += 1
            except Exception as exc:
                self.change_failures[f"{type(exc).__name__}: {str(exc)[:100]}"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.rng.uniform(0.2, 2 * self.args.change_interval))

    # --- faults ---

    @contextlib.asynccontextmanager
    async def fault(self, kind: str, target: str) -> AsyncIterator[Fault]:
        fault = Fault(kind, target, time.time())
        self.faults.append(fault)
        print(f"  [{fault.started - self.t0:6.1f}s] fault: {kind} {target}", flush=True)
        try:
            yield fault
        finally:
            fault.ended = time.time()
            print(
                f"  [{fault.ended - self.t0:6.1f}s]   recovered from {kind} {target} {fault.note}", flush=True
            )

    async def inject(self, kind: str) -> None:
        assert self.http is not None
        http = self.http
        if kind == "kill-worker":
            gateway = self.rng.choice([g for g in self.gateways if g.up])
            victim = self.rng.choice(gateway.workers())
            async with self.fault(kind, f"kvgate-{gateway.index} worker {victim}") as fault:
                os.kill(victim, signal.SIGKILL)
                started = time.monotonic()

                async def replaced() -> bool:
                    now = gateway.workers()
                    whole = len(now) == self.args.workers and victim not in now
                    return whole and await gateway.healthy(http)

                await until(
                    replaced, READY_S, f"kvgate {gateway.index} has {self.args.workers} workers again"
                )
                fault.note = (
                    f"(its parent started another worker; healthy {time.monotonic() - started:.1f} s after)"
                )
        elif kind == "kill-kvgate":
            gateway = self.rng.choice(self.gateways)
            async with self.fault(kind, f"kvgate-{gateway.index}"):
                await gateway.kill9()
                await asyncio.sleep(2)
                await gateway.start(self.http)
        elif kind == "restart-vllm":
            index = self.rng.randrange(len(self.replicas))
            old = self.replicas[index]
            async with self.fault(kind, old.url) as fault:
                await old.stop()
                spec = replace(old.spec, log_path=self.work / f"vllm-{index}-restart-{len(self.faults)}.log")
                self.replicas[index] = VllmProcess(spec)
                await self.replicas[index].start()
                started = time.monotonic()
                await until(lambda: self.all_see_replica(old.url), 60, "every kvgate sees the replica again")
                fault.note = f"(kvgates saw it healthy {time.monotonic() - started:.1f} s after it answered)"
        else:
            empty = kind == "restart-redis-empty"
            async with self.fault(kind, self.redis_server.url) as fault:
                self.redis_up.clear()
                await self.redis_server.kill()
                await asyncio.sleep(2)
                if empty:
                    self.redis_server.wipe()
                await self.redis_server.start()
                restarted = time.monotonic()
                await until(self.all_serve_every_tenant, 60, "every kvgate serves every tenant again")
                fault.note = (
                    f"(every kvgate serves every tenant {time.monotonic() - restarted:.2f} s after restart)"
                )
                if empty:
                    self.reseed_s.append(time.monotonic() - restarted)
                self.redis_up.set()

    async def all_see_replica(self, url: str) -> bool:
        assert self.http is not None
        for gateway in self.gateways:
            try:
                doc = await gateway.status(self.http)
            except (aiohttp.ClientError, TimeoutError):
                return False
            if not any(r["url"] == url and r["healthy"] for r in doc["replicas"]):
                return False
        return True

    async def all_serve_every_tenant(self) -> bool:
        """Every kvgate's snapshot is fresh (not flushed) and holds every tenant, as in Redis."""
        assert self.http is not None
        wanted = {}
        try:
            for i in range(self.args.tenants):
                state = await self.state(f"tenant-{i}")
                if state is None:
                    return False
                wanted[f"tenant-{i}"] = state[:2]
        except REDIS_DOWN:
            return False
        for gateway in self.gateways:
            try:
                doc = await gateway.status(self.http)
            except (aiohttp.ClientError, TimeoutError):
                return False
            held = {t: (v["epoch"], v["digest"]) for t, v in doc["versions"].items()}
            if doc["snapshot_flushed"] or any(held.get(t) != w for t, w in wanted.items()):
                return False
        return True

    async def faults_on_schedule(self, plan: list[str]) -> None:
        for kind, at in zip(plan, fault_points(plan, self.args.requests), strict=True):
            self.fault_at = at
            self.fault_due.clear()
            if self.issued < at:
                await self.fault_due.wait()
            try:
                await self.inject(kind)
            except Exception as exc:  # a fault that does not recover is a finding, not a crash
                log.exception("fault %s did not recover", kind)
                self.faults[-1].note = f"DID NOT RECOVER: {exc}"
                self.redis_up.set()

    # --- the whole run ---

    async def run(self) -> None:
        requests = self.args.requests
        self.t0 = time.time()
        print(f"running {requests} requests ({self.args.concurrency} clients), changes and faults ...")
        workers = [asyncio.create_task(self.traffic(i)) for i in range(self.args.concurrency)]
        changer = asyncio.create_task(self.change_forever())
        sampler = asyncio.create_task(self.sample_listings())
        progress = asyncio.create_task(self.progress())
        faults = asyncio.create_task(self.faults_on_schedule(fault_plan(requests)))
        try:
            await self.enough.wait()
            await faults  # every fault in the plan runs, and recovers, before the traffic stops
        finally:
            self.stop.set()
            progress.cancel()
            await asyncio.gather(*workers, changer, sampler, progress, *self.exiting, return_exceptions=True)
            faults.cancel()
            await asyncio.gather(faults, return_exceptions=True)
        self.t1 = time.time()
        await self.scrape_metrics()

    async def progress(self) -> None:
        """A line a minute: how far the run is."""
        while True:
            await asyncio.sleep(60)
            done = sum(o.complete for o in self.outcomes)
            print(
                f"  [{time.time() - self.t0:6.1f}s] {self.issued} requests begun, {done} complete, "
                f"{sum(o.check == 'checked' for o in self.outcomes)} recomputed, {len(self.faults)} faults",
                flush=True,
            )

    async def scrape_metrics(self) -> None:
        """Counters from the kvgates alive at the end (a killed kvgate's counts died with it)."""
        assert self.http is not None
        wanted = {
            "kvgate_adapter_unloads": "reason",
            "kvgate_adapter_loads": "outcome",
            "kvgate_routing_decisions": "decision",
            "kvgate_quarantines": "reason",
            "kvgate_audit_verdicts": "verdict",
            "kvgate_table_reseeded_versions": "outcome",
            "kvgate_token_checks": "result",
            "kvgate_prefix_claimed_tokens": "",
            "kvgate_prefix_confirmed_tokens": "",
            "kvgate_agent_fetches": "outcome",
            "kvgate_rollout_gate_aborts": "reason",
            "kvgate_worker_restarts": "",
        }
        totals: dict[str, Counter[str]] = {name: Counter() for name in wanted}
        for gateway in self.gateways:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(
                    f"{gateway.url}/metrics", headers={ADMIN_TOKEN_HEADER: TOKEN}
                ) as response:
                    text = await response.text()
                for family in text_string_to_metric_families(text):
                    if family.name in wanted:
                        for sample in family.samples:
                            if sample.name.endswith("_total"):
                                label = sample.labels.get(wanted[family.name], "")
                                totals[family.name][label] += int(sample.value)
        self.metrics = totals


class ChangeFailed(Exception):
    """A change the table refused (e.g. a rollback with no earlier version after the table was emptied)."""


# --- the report --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


def during_fault(out: Outcome, faults: Sequence[Fault], settle: float = 5.0) -> str | None:
    """The fault whose window (plus ``settle`` seconds) overlaps the request, if any."""
    for fault in faults:
        end = (fault.ended or out.ended) + settle
        if out.started <= end and out.ended >= fault.started:
            return fault.kind
    return None


def cut_cause(out: Outcome, run: Run) -> str:
    """Why a stream was cut: its kvgate was killed, its replica restarted, or neither (an unload?)."""
    for fault in run.faults:
        end = (fault.ended or out.ended) + 1.0
        if not (out.started <= end and out.ended >= fault.started):
            continue
        if fault.kind == "kill-kvgate" and fault.target == f"kvgate-{out.gateway}":
            return "its kvgate was killed (kill -9)"
        if fault.kind == "kill-worker" and fault.target.startswith(f"kvgate-{out.gateway} "):
            return "a worker of its kvgate was killed (kill -9; perhaps the one serving it)"
        if fault.kind == "restart-vllm" and fault.target == out.replica:
            return "its vLLM replica was restarted"
    return "unexplained (an unload?)"


def report(run: Run) -> str:
    outs = run.outcomes
    ok = [o for o in outs if o.complete]
    tolerance = judge(outs)
    checked = [o for o in outs if o.check == "checked"]
    exact = [o for o in checked if o.max_diff <= EPSILON]
    within = [o for o in checked if o.verdict == "coherent" and o.max_diff > EPSILON]
    not_recomputable: Counter[str] = Counter()
    for o in outs:
        if o.check.startswith("not-recomputable"):  # the answer and its cold runs, against the faults
            when = during_fault(replace(o, started=o.ended, ended=o.checked_at or o.ended), run.faults)
            not_recomputable[f"{o.check} ({'during ' + when if when else 'outside any fault'})"] += 1
    retired = [  # answers still running a drain grace after every kvgate saw their version retired
        o
        for o in outs
        if o.status == 200
        and any(
            c.tenant == o.tenant and c.digest != o.digest and o.started < c.at < o.ended - DRAIN_GRACE_S
            for c in run.changes
        )
    ]
    incoherent = [o for o in outs if o.verdict == "incoherent"]
    ties = [o for o in outs if o.verdict == "tie"]
    errors: Counter[str] = Counter()
    samples: dict[str, str] = {}
    for o in outs:
        if o.error is None:
            continue
        when = during_fault(o, run.faults)
        kind = f"{o.error} ({'during ' + when if when else 'outside any fault'})"
        errors[kind] += 1
        samples.setdefault(kind, o.detail[:160])
    cuts: Counter[str] = Counter(cut_cause(o, run) for o in outs if o.cut is not None and o.status == 200)
    cut_samples = {cut_cause(o, run): o.cut for o in outs if o.cut is not None and o.status == 200}
    hung = sum(o.error == "hung" for o in outs)
    streams = sum(1 for o in outs if "stream" in o.shape)
    propagations = [c.propagation.sent_ms for c in run.changes if c.propagation.sent_ms is not None]
    upper = [c.propagation.answered_ms for c in run.changes if c.propagation.answered_ms is not None]
    unmeasured = sum(c.propagation.sent_ms is None for c in run.changes)
    calm = [
        c.propagation.sent_ms
        for c in run.changes
        if c.propagation.sent_ms is not None
        and not any(f.started <= c.at and (f.ended or c.at) + 5.0 >= c.started for f in run.faults)
    ]
    latencies = [o.ended - o.started for o in ok]
    nondeterministic = [o for o in outs if o.verdict == "nondeterministic"]
    differences = run.checker.replica_differences if run.checker else []
    calibration_failures = run.checker.calibration_failures if run.checker else Counter()
    spreads = [o.cold_spread for o in checked if o.cold_spread is not None]
    sampled = sum(o.check != "unsampled" for o in outs)
    faults = Counter(f.kind for f in run.faults)
    leaks = sum(o.model_leaks for o in outs)
    mismatched_evidence = sum(
        1 for o in ok if o.version and o.digest and o.version.partition("@")[2] != o.digest[:16]
    )
    by_replica = Counter(o.replica for o in ok)
    matches = Counter((o.match or "none").partition(":")[0] for o in ok)
    matched = sum(1 for o in ok if (o.match or "").partition(":")[2] not in ("", "0"))
    roles = Counter(o.role for o in ok if o.role)
    minutes = (run.t1 - run.t0) / 60
    a = run.args
    lines = [
        f"Seed {a.seed}; {len(outs)} requests in {minutes:.1f} minutes "
        f"({len(outs) / max(1.0, run.t1 - run.t0):.1f}/s), {a.concurrency} concurrent clients, {a.tenants} "
        f"tenants, {a.kvgates} kvgates x {a.workers} workers (default routing), 2 vLLM CPU replicas "
        "publishing KV events, adapters in an S3 object store (moto) fetched by one agent per replica.",
        "",
        "| figure | value | target |",
        "| --- | ---: | ---: |",
        f"| requests | {len(outs)} ({streams} streaming) | ≥ {a.requests} |",
        f"| complete answers | {len(ok)} | |",
        f"| version or epoch changes | {len(run.changes)} | ≥ 50 |",
        f"| faults injected | {len(run.faults)}: "
        + ", ".join(f"{k} x{faults[k]}" for k in FAULT_KINDS)
        + " | every kind ≥ 1 |",
        f"| faults that did not recover within their bound | "
        f"{sum('DID NOT RECOVER' in f.note for f in run.faults)} | 0 |",
        f"| answers recomputed cold on their replica | {sampled} of {len(ok)} "
        f"(1 in {run.args.sample_every} sampled) | ≥ 1 in 5 |",
        f"| answers judged (recomputed cold on their replica and compared) | {len(checked)} | |",
        f"| sampled, not judged (the cold run failed; why below) | {sum(not_recomputable.values())} | |",
        f"| incoherent answers | {len(incoherent)} | 0 |",
        f"| judged a near-tie flipped by noise within the tolerance (same tokens up to it; see below) | "
        f"{len(ties)} | |",
        f"| complete answers routed on matched cached blocks (`x-kvgate-prefix-match` > 0); every "
        f"complete answer by the index that decided it | {matched}; "
        + ", ".join(f"{k} {n}" for k, n in sorted(matches.items()))
        + " | |",
        "| complete answers while a rollout ran, by the version's role | "
        + (", ".join(f"{k} {n}" for k, n in sorted(roles.items())) or "none")
        + " | both |",
        f"| hung requests (no answer in {DEADLINE_S:.0f} s) | {hung} | 0 |",
        f"| answers (streaming) still running {DRAIN_GRACE_S:g} s (the drain grace) after every kvgate saw "
        f"their version retired, and finished | {sum(o.complete for o in retired)} of {len(retired)} "
        f"({sum('stream' in o.shape for o in retired)}) | all |",
        f"| streams cut, unexplained by a kill or a replica restart (an unload?) | "
        f"{cuts.get('unexplained (an unload?)', 0)} | 0 |",
        f"| not recomputable (sampled, but the cold run failed) | {sum(not_recomputable.values())} | small |",
        f"| sampled versions gone from their replica, loaded again for the recomputation | "
        f"{sum(o.self_loaded for o in outs)} | |",
        f"| nondeterministic (cold runs disagreed with each other: nothing to judge) | "
        f"{len(nondeterministic)} | 0 |",
        f"| same request and version, cold answers differ across the replicas (beyond the tolerance) | "
        f"{sum(d > tolerance + EPSILON for *_, d in differences)} | 0 |",
        f"| responses whose `model` was not the logical ID | {leaks} | 0 |",
        f"| evidence headers whose name and digest disagree | {mismatched_evidence} | 0 |",
        f"| change → every live kvgate routes it (ms): p50 / p99 / max, by the poll that first showed it "
        f"sent | {_quantiles(propagations)} (n={len(propagations)}; {unmeasured} not seen within "
        f"{PROPAGATION_DEADLINE_S:.0f} s) | p99 ≤ 50 |",
        f"| the same, by that poll answered (an upper bound) | {_quantiles(upper)} | |",
        "| the same (poll sent), changes outside any fault window (+5 s) | "
        f"{_quantiles(calm)} (n={len(calm)}) | |",
        "| `/kvgate/status` round trip while polling (ms): p50 / p99 / max | "
        f"{_quantiles(run.status_rtt_ms)} | |",
        f"| complete answers, seconds from request to last byte: p50 / p99 / max | "
        f"{_quantiles(latencies, '.1f')} | |",
        "| vLLM `/v1/models` round trip, sampled every 2 s (ms): p50 / p99 / max | "
        f"{_quantiles(run.listing_rtt_ms)} | |",
        "| Redis restarted empty → every kvgate serves every tenant again (s) | "
        + (", ".join(f"{s:.2f}" for s in run.reseed_s) or "-")
        + " | |",
        "",
        f"Coherence (the audit's rule over the whole run): an answer is coherent when it has the tokens of "
        f"one of its cold runs and max |dlogprob| to it is at most the tolerance + {EPSILON:g}; the "
        f"tolerance is {TOLERANCE_MARGIN:g} x the largest |dlogprob| seen between two cold runs of one "
        f"request with the same tokens (each check runs one cold run; three when the first differs at all, "
        f"and on every {CALIBRATE_EVERY}th check whatever it finds). This run: {len(spreads)} calibrations, "
        f"largest cold-to-cold |dlogprob| {max(spreads, default=0.0):.2g}, so the tolerance is "
        f"{tolerance:.2g}. Of {len(checked)} answers judged, {len(exact)} equal their cold run exactly "
        f"(max |dlogprob| 0) and {len(within)} agree within the tolerance (largest "
        f"{max((o.max_diff for o in within), default=0.0):.2g}). Calibration cold runs that failed: "
        + (", ".join(f"{_cell(k)} x{n}" for k, n in calibration_failures.items()) or "none")
        + ".",
        "",
        _divergences("Near-ties flipped", [(o.diverges_at, o.prefix_diff or 0.0) for o in ties])
        + (f" Largest tie gap {max(o.tie_gap or 0.0 for o in ties):.2g}." if ties else ""),
        "",
        _divergences(
            "Nondeterministic answers", [(o.diverges_at, o.prefix_diff or 0.0) for o in nondeterministic]
        ),
        "",
        _divergences(
            "Cold answers differing at all between replicas", [(at, d) for _, at, d, _ in differences]
        ),
        "",
        "Complete answers per replica: "
        + ", ".join(f"{r}: {n}" for r, n in sorted(by_replica.items()))
        + ".",
        "",
        "Commands that succeeded, by kind: "
        + ", ".join(f"{op} {n}" for op, n in sorted(run.ops_done.items()))
        + ". Version or epoch changes, by kind: "
        + ", ".join(f"{op} {n}" for op, n in sorted(Counter(c.op for c in run.changes).items()))
        + ". Changes refused: "
        + (", ".join(f"{reason} x{n}" for reason, n in run.change_failures.items()) or "none")
        + ".",
        "",
        f"Connections refused by a killed kvgate and sent to the next one: {run.refused_retried}.",
        "",
        "Errors by kind (each with a sample message):",
        "",
        "| error | count | sample |",
        "| --- | ---: | --- |",
        *(f"| {kind} | {n} | {_cell(samples[kind])} |" for kind, n in errors.most_common()),
        *(["| (none) | 0 | |"] if not errors else []),
        "",
        "Streams (and long answers) that began and did not finish, by cause:",
        "",
        "| cause | count | sample |",
        "| --- | ---: | --- |",
        *(f"| {cause} | {n} | {_cell(cut_samples[cause])} |" for cause, n in cuts.most_common()),
        *(["| (none) | 0 | |"] if not cuts else []),
        "",
        "Not recomputable, by reason: "
        + (", ".join(f"{_cell(k)} x{n}" for k, n in not_recomputable.items()) or "none")
        + ".",
        "",
        "Counters from the kvgates alive at the end (a killed kvgate's counters died with it): "
        + "; ".join(
            f"{name.removeprefix('kvgate_')} "
            + (", ".join(f"{label or '-'} {n}" for label, n in sorted(counts.items())) or "none")
            for name, counts in run.metrics.items()
        )
        + ".",
        "",
        "Faults, in order (seconds from the start of traffic):",
        "",
        *(
            f"- {f.started - run.t0:.0f} s: {f.kind} {f.target}, recovered after "
            f"{(f.ended or f.started) - f.started:.1f} s {f.note}"
            for f in run.faults
        ),
    ]
    if incoherent:
        lines += ["", "Incoherent answers (first 10):", ""]
        lines += [
            f"- {o.version} on {o.replica} via kvgate-{o.gateway}, {o.shape}, epoch {o.epoch}: first differs "
            f"from the cold run at token {o.diverges_at}, max |dlogprob| before it "
            f"{o.prefix_diff or 0.0:.2g}, "
            f"to the closest cold run {o.max_diff:.2g}, tie gap "
            f"{'-' if o.tie_gap is None else format(o.tie_gap, '.2g')}"
            for o in incoherent[:10]
        ]
    return "\n".join(lines)


def _divergences(what: str, found: Sequence[tuple[int | None, float]]) -> str:
    """A summary of where answers that should agree part: a version mix-up differs from the first
    generated token with a large |dlogprob|; a near-tie flipped by batching noise later, with a tiny one."""
    if not found:
        return f"{what}: none."
    firsts = sorted(at for at, _ in found if at is not None)
    parts = (
        [f"{len(firsts)} first differ at generated token " + ", ".join(map(str, firsts))] if firsts else []
    )
    if len(firsts) < len(found):
        parts.append(f"{len(found) - len(firsts)} have the same tokens")
    return (
        f"{what}: {len(found)}; " + ", ".join(parts) + "; the largest |dlogprob| on the tokens they share: "
        f"{max(d for _, d in found):.2g}."
    )


def _quantiles(values: Sequence[float], spec: str = ".0f") -> str:
    return " / ".join(
        format(v, spec)
        for v in (percentile(values, 0.5), percentile(values, 0.99), max(values, default=math.nan))
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def write_section(path: Path, body: str, title: str) -> None:
    """This command's generated block of ``path`` (gateway/dev/generated_docs.py) replaced, or added under
    ``## title``, leaving the rest as it is."""
    text = path.read_text() if path.exists() else "# The chaos run: a fleet of kvgates, one truth\n"
    block = generated_docs.measured(body)
    module = generated_docs.module_of(generated_docs.this_command())
    if not any(generated_docs.module_of(b.command) == module for b in generated_docs.blocks(text)):
        text = text.rstrip("\n") + f"\n\n## {title}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated_docs.with_block(text, block))


def failures(outcomes: Sequence[Outcome], faults: Sequence[Fault]) -> list[str]:
    """Why the run fails (judged outcomes: after ``judge``): an incoherent answer, a fault kind that never
    ran, or no answer judged at all."""
    found = []
    incoherent = sum(o.verdict == "incoherent" for o in outcomes)
    if incoherent:
        found.append(f"{incoherent} incoherent answers")
    missing = sorted(set(FAULT_KINDS) - {f.kind for f in faults})
    if missing:
        found.append(f"fault kinds never injected: {', '.join(missing)}")
    if not any(o.check == "checked" for o in outcomes):
        found.append("no answer was judged")
    return found


async def main_async(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    run = Run(args, work)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(run.records.close)
        await run.setup(stack)
        await run.run()
    body = report(run)
    with (work / "records.jsonl").open("w") as records:  # again, with the verdicts
        records.writelines(json.dumps(asdict(out)) + "\n" for out in run.outcomes)
    write_section(args.out, body, "Results")
    print(body)
    print(f"\nrecords and logs: {work}")
    failed = failures(run.outcomes, run.faults)
    for reason in failed:
        print(f"FAILED: {reason}")
    return 1 if failed else 0


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", type=Path, required=True)
    parser.add_argument("--fixture-dir", type=Path, required=True)
    parser.add_argument(
        "--requests",
        type=int,
        default=10_000,
        help="requests to send (traffic goes on until every fault recovered)",
    )
    parser.add_argument(
        "--vllm-threads", type=int, default=1, help="each replica's torch threads (OMP_NUM_THREADS)"
    )
    parser.add_argument("--kvgates", type=int, default=2, help="kvgate serve processes")
    parser.add_argument("--workers", type=int, default=2, help="each kvgate's --workers")
    parser.add_argument("--concurrency", type=int, default=12, help="concurrent clients")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=5, help="recompute one complete answer in N")
    parser.add_argument("--change-interval", type=float, default=5.0, help="mean seconds between changes")
    parser.add_argument("--budget", type=int, default=6, help="kvgate's --max-adapters-per-replica")
    parser.add_argument("--canary-interval", type=float, default=0.0, help="kvgate's canary (0: off)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/chaos.md"))
    args = parser.parse_args()
    generated_docs.started_tree()  # the tree measured, taken before the run
    if args.sample_every > 5:
        parser.error("--sample-every must be at most 5 (the issue asks for at least one in five)")
    loop_main = main_async(args)
    sys.exit(asyncio.run(_cancel_on_sigterm(loop_main)))


async def _cancel_on_sigterm(coro: Awaitable[int]) -> int:
    """SIGTERM cancels the run like Ctrl-C, so every process it started is stopped on the way out."""
    task = asyncio.ensure_future(coro)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


if __name__ == "__main__":
    main()
