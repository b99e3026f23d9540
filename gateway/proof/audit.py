"""The coherence audit: the cold-versus-warm experiment, automated, against any deployment.

Per replica, pinned: the same long prompt runs *warm* (the production cache namespace, twice, so the
second is a hit) and *cold* (a fresh namespace, several times, to calibrate the tolerance: GPU kernels are
not bit-exact; the CPU build is). Verdicts per replica:

- ``nondeterministic``: cold runs disagree with each other; nothing else can be judged.
- ``replica-mismatch``: this replica serves another version than the reference (its digest or its cold
  answer differs): mixed versions across replicas, a separate cause from cache identity.
- ``incoherent-on-warm-hit``: a warm request that hit the prefix cache disagrees with cold: the cache
  identity or invalidation fault kvgate exists to prevent.
- ``coherent``.
- ``cannot-audit``: the server's context cannot hold a probe over two KV blocks (``probe.py``); no
  verdict on coherence is drawn.

The probe is sized for the audited server: its context (``max_model_len``) and its own tokenizer.

Targets: through kvgate (``GatewayTarget``: pinning and a cold namespace via the admin token) or a raw
server (``DirectTarget``: ``cache_salt`` for cold, no kvgate involved).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from gateway.core.errors import AuditError, InvalidAdapter, Unauthorized
from gateway.core.identity import scan_adapter, tree_digest
from gateway.core.wire import (
    ADMIN_TOKEN_HEADER,
    DIGEST_HEADER,
    NAMESPACE_HEADER,
    PIN_HEADER,
    PREFIX_KEY_HEADER,
    VERSION_HEADER,
    cold_salt,
)
from gateway.fleet.backends import fetch_model_list
from gateway.proof.experiment import PROBE_MAX_TOKENS, Sample, complete
from gateway.proof.probe import CannotAudit, Probe, fit_probe

COHERENT = "coherent"
INCOHERENT = "incoherent-on-warm-hit"
MISMATCH = "replica-mismatch"
NONDETERMINISTIC = "nondeterministic"
CANNOT_AUDIT = "cannot-audit"
FAULTS = (INCOHERENT, MISMATCH, NONDETERMINISTIC)
TOLERANCE_MARGIN = 2.0  # tolerance = margin x the largest disagreement among cold runs


@dataclass(frozen=True, slots=True)
class Observation:
    """Everything one replica answered for one audit round."""

    replica: str
    served: str  # the name the replica served (versioned name through kvgate)
    digest: str | None  # adapter artifact digest, when known
    loaded_root: str | None  # what the replica's /v1/models lists for that name
    block_key: str | None  # the gateway's first prefix block key
    warm: tuple[Sample, ...]
    cold: tuple[Sample, ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    replica: str
    verdict: str
    detail: str
    tolerance: float
    cached_tokens: int
    observation: Observation = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["observation"] = asdict(self.observation)
        return doc


def judge(
    observations: Sequence[Observation], expected_digest: str | None = None, fingerprint: Sample | None = None
) -> list[Verdict]:
    """Verdicts for one round. The reference is ``expected_digest``, else the most common digest;
    ``fingerprint`` is the version's cold answer recorded earlier (the canary's, from its first load)."""
    digests = [o.digest for o in observations if o.digest]
    reference_digest = expected_digest or (Counter(digests).most_common(1)[0][0] if digests else None)
    reference = next((o for o in observations if o.digest == reference_digest), observations[0])
    return [_judge_one(o, reference, reference_digest, fingerprint) for o in observations]


def _judge_one(
    obs: Observation, reference: Observation, reference_digest: str | None, fingerprint: Sample | None
) -> Verdict:
    first_cold = obs.cold[0]
    spread = max((first_cold.max_logprob_diff(other) for other in obs.cold[1:]), default=0.0)
    tolerance = spread * TOLERANCE_MARGIN
    hit = max((w.cached_tokens for w in obs.warm), default=0)

    def verdict(name: str, detail: str) -> Verdict:
        return Verdict(obs.replica, name, detail, tolerance, hit, obs)

    if any(c.text != first_cold.text for c in obs.cold[1:]):
        return verdict(NONDETERMINISTIC, "cold runs disagree with each other")
    if reference_digest and obs.digest and obs.digest != reference_digest:
        return verdict(MISMATCH, f"serves digest {obs.digest[:16]}, reference is {reference_digest[:16]}")
    if fingerprint is not None and not first_cold.agrees_with(fingerprint, tolerance):
        diff = first_cold.max_logprob_diff(fingerprint)
        return verdict(
            MISMATCH, f"cold answer differs from the version's fingerprint: max |dlogprob| {diff:.4f}"
        )
    if obs is not reference and not first_cold.agrees_with(reference.cold[0], tolerance):
        return verdict(MISMATCH, f"cold answer differs from reference replica {reference.replica}")
    for warm in obs.warm:
        if warm.cached_tokens and not warm.agrees_with(first_cold, tolerance):
            diff = warm.max_logprob_diff(first_cold)
            return verdict(
                INCOHERENT,
                f"warm hit ({warm.cached_tokens} cached tokens) differs from cold: max |dlogprob| {diff:.4f}",
            )
    detail = (
        f"warm == cold ({hit} cached tokens)" if hit else "warm == cold, but no warm request hit the cache"
    )
    return verdict(COHERENT, detail)


async def warm_and_cold(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    colds: int,
    *,
    warm_salt: str | None = None,
) -> tuple[tuple[Sample, ...], tuple[Sample, ...]]:
    """Straight to a server: two warm runs in ``warm_salt``'s namespace (the server's default when None),
    so the second hits the cache, then ``colds`` runs, each in a fresh namespace."""
    warm = [await complete(http, url, model, prompt, cache_salt=warm_salt) for _ in range(2)]
    cold = [await complete(http, url, model, prompt, cache_salt=cold_salt()) for _ in range(colds)]
    return tuple(warm), tuple(cold)


class AuditTarget(Protocol):
    async def replicas(self, http: aiohttp.ClientSession) -> list[str]: ...

    async def context(self, http: aiohttp.ClientSession, replica: str) -> int | None:
        """The replica's context length in tokens, when it reports one."""
        ...

    async def count_tokens(self, http: aiohttp.ClientSession, replica: str, prompt: str) -> int:
        """Prompt tokens of ``prompt`` with the replica's own tokenizer (a throwaway, cold request)."""
        ...

    async def observe(
        self, http: aiohttp.ClientSession, replica: str, prompt: str, colds: int
    ) -> Observation: ...


@dataclass(frozen=True)
class DirectTarget:
    """A raw OpenAI-compatible server (vLLM): cold runs use a fresh ``cache_salt``."""

    urls: tuple[str, ...]
    model: str

    async def replicas(self, http: aiohttp.ClientSession) -> list[str]:
        return list(self.urls)

    async def context(self, http: aiohttp.ClientSession, replica: str) -> int | None:
        return (await fetch_model_list(http, replica)).max_model_len

    async def count_tokens(self, http: aiohttp.ClientSession, replica: str, prompt: str) -> int:
        sample = await complete(http, replica, self.model, prompt, max_tokens=1, cache_salt=cold_salt())
        return sample.prompt_tokens

    async def observe(
        self, http: aiohttp.ClientSession, replica: str, prompt: str, colds: int
    ) -> Observation:
        warm, cold = await warm_and_cold(http, replica, self.model, prompt, colds)
        root = (await fetch_model_list(http, replica)).adapters.get(self.model)
        return Observation(replica, self.model, observed_digest(root), root, None, warm, cold)


@dataclass(frozen=True)
class GatewayTarget:
    """A logical ID through kvgate: pinned per replica, cold via the admin-only fresh namespace."""

    gateway: str
    logical_id: str
    admin_token: str

    async def replicas(self, http: aiohttp.ClientSession) -> list[str]:
        return [r["url"] for r in await self._replica_view(http) if r["healthy"]]

    async def context(self, http: aiohttp.ClientSession, replica: str) -> int | None:
        view = {r["url"]: r for r in await self._replica_view(http)}
        context = view.get(replica, {}).get("max_model_len")
        return context if isinstance(context, int) else None

    async def count_tokens(self, http: aiohttp.ClientSession, replica: str, prompt: str) -> int:
        headers = {PIN_HEADER: replica, ADMIN_TOKEN_HEADER: self.admin_token, NAMESPACE_HEADER: "cold"}
        sample = await complete(http, self.gateway, self.logical_id, prompt, max_tokens=1, headers=headers)
        return sample.prompt_tokens

    async def observe(
        self, http: aiohttp.ClientSession, replica: str, prompt: str, colds: int
    ) -> Observation:
        pin = {PIN_HEADER: replica, ADMIN_TOKEN_HEADER: self.admin_token}
        warm = [await complete(http, self.gateway, self.logical_id, prompt, headers=pin) for _ in range(2)]
        cold_headers = {**pin, NAMESPACE_HEADER: "cold"}
        cold = [
            await complete(http, self.gateway, self.logical_id, prompt, headers=cold_headers)
            for _ in range(colds)
        ]
        evidence = warm[-1].evidence
        served = evidence.get(VERSION_HEADER, self.logical_id)
        view = {r["url"]: r for r in await self._replica_view(http)}
        root = view.get(replica, {}).get("adapters", {}).get(served)
        return Observation(
            replica, served, evidence.get(DIGEST_HEADER), root, evidence.get(PREFIX_KEY_HEADER),
            tuple(warm), tuple(cold),
        )  # fmt: skip

    async def _replica_view(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        view: list[dict[str, Any]] = (await self.status(http))["replicas"]
        return view

    async def status(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        headers = {ADMIN_TOKEN_HEADER: self.admin_token}
        async with http.get(f"{self.gateway}/kvgate/status", headers=headers) as response:
            if response.status == 401:
                raise Unauthorized(f"{self.gateway} refused the admin token: {await response.text()}")
            if response.status == 404:
                raise AuditError(
                    f"{self.gateway} does not serve /kvgate/status: if kvgate has an admin listener "
                    "(admin_port), audit through it"
                )
            if response.status != 200:
                raise AuditError(
                    f"{self.gateway}/kvgate/status answered {response.status}: {await response.text()}"
                )
            doc: dict[str, Any] = await response.json()
            return doc

    async def serves(self, http: aiohttp.ClientSession, digest: str) -> bool:
        """Whether the gateway's snapshot already serves ``digest`` for the logical ID."""
        current = (await self.status(http))["versions"].get(self.logical_id, {})
        return bool(current.get("digest") == digest)

    async def until_serving(self, http: aiohttp.ClientSession, digest: str, *, within: float = 15.0) -> None:
        """Wait for a publish to reach the gateway's snapshot (a hint, or at worst a reconcile)."""
        for _ in range(int(within / 0.05)):
            if await self.serves(http, digest):
                return
            await asyncio.sleep(0.05)
        raise AuditError(f"{self.gateway} did not switch {self.logical_id} to {digest[:16]} in {within} s")


async def audit_round(
    http: aiohttp.ClientSession,
    target: AuditTarget,
    *,
    colds: int = 2,
    expected_digest: str | None = None,
    prompt: str | None = None,
) -> list[Verdict]:
    replicas = await target.replicas(http)
    if not replicas:
        raise AuditError("no healthy replica to audit")
    if prompt is None:
        try:
            prompt = (await size_probe(http, target, replicas)).prompt
        except CannotAudit as exc:
            return [cannot_audit(replica, exc.message) for replica in replicas]
    observations = [await target.observe(http, replica, prompt, colds) for replica in replicas]
    return judge(observations, expected_digest)


async def size_probe(http: aiohttp.ClientSession, target: AuditTarget, replicas: Sequence[str]) -> Probe:
    """One probe for every replica (so their answers compare): the smallest context, the first tokenizer."""
    contexts = [context for replica in replicas if (context := await target.context(http, replica))]

    async def count(prompt: str) -> int:
        return await target.count_tokens(http, replicas[0], prompt)

    return await fit_probe(count, min(contexts, default=None), max_tokens=PROBE_MAX_TOKENS)


def cannot_audit(replica: str, reason: str) -> Verdict:
    nothing = Observation(replica, "", None, None, None, (), ())
    return Verdict(replica, CANNOT_AUDIT, reason, 0.0, 0, nothing)


async def audit_before_after(
    http: aiohttp.ClientSession,
    target: AuditTarget,
    update: Callable[[], Awaitable[str | None]],
    *,
    colds: int = 2,
) -> tuple[list[Verdict], list[Verdict]]:
    """Audit (which warms the cache), run ``update`` (it may return the new expected digest), audit again."""
    before = await audit_round(http, target, colds=colds)
    expected = await update()
    after = await audit_round(http, target, colds=colds, expected_digest=expected)
    return before, after


async def run_shell(command: str) -> None:
    process = await asyncio.create_subprocess_shell(command)
    if await process.wait() != 0:
        raise AuditError(f"update command failed with exit code {process.returncode}: {command}")


def observed_digest(root: str | None) -> str | None:
    """The artifact digest of the bytes at a replica's loaded root, when this machine can read it."""
    if not root:
        return None
    try:
        path = Path(root)
        return tree_digest(path, scan_adapter(path))
    except InvalidAdapter:
        return None


def render(title: str, verdicts: Sequence[Verdict]) -> str:
    lines = [title, f"{'REPLICA':<24} {'SERVED':<30} {'DIGEST':<17} {'CACHED':>6} {'TOL':>7}  VERDICT"]
    for v in verdicts:
        o = v.observation
        digest = (o.digest or "?")[:16]
        lines.append(
            f"{v.replica.removeprefix('http://'):<24} {o.served:<30} {digest:<17} {v.cached_tokens:>6} "
            f"{v.tolerance:>7.4f}  {v.verdict}: {v.detail}"
        )
    return "\n".join(lines)


def to_json(rounds: Mapping[str, Sequence[Verdict]]) -> str:
    return json.dumps({name: [v.to_json() for v in verdicts] for name, verdicts in rounds.items()}, indent=2)


def faulty(verdicts: Sequence[Verdict]) -> bool:
    """A fault was found (``cannot-audit`` is no verdict, not a fault)."""
    return any(v.verdict in FAULTS for v in verdicts)
