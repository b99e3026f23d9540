"""The coherence audit: the cold-versus-warm experiment, automated, against any deployment.

Per replica, pinned: the same long prompt runs *warm* (the production cache namespace, twice, so the
second is a hit) and *cold* (a fresh namespace, several times, to calibrate the tolerance: GPU kernels are
not bit-exact; the CPU build is). Verdicts per replica:

- ``nondeterministic``: cold runs disagree with each other; nothing else can be judged.
- ``replica-mismatch``: this replica serves another version than the reference (its digest or its cold
  answer differs): mixed versions across replicas, a separate cause from cache identity; or another
  base under the version's base name (kvgate reports its base fingerprint differs from the one the
  version was published for: the detail names both).
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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
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
from gateway.proof.verdicts import (
    CANNOT_AUDIT,
    COHERENT,
    FAULTS,
    INCOHERENT,
    MISMATCH,
    NONDETERMINISTIC,
    TOLERANCE_MARGIN,
    Observation,
    Verdict,
    cannot_audit,
    faulty,
    judge,
)

__all__ = [  # the verdicts live in proof.verdicts; callers take them from here with the experiment
    "CANNOT_AUDIT", "COHERENT", "FAULTS", "INCOHERENT", "MISMATCH", "NONDETERMINISTIC", "TOLERANCE_MARGIN",
    "AuditTarget", "DirectTarget", "GatewayTarget", "Observation", "Verdict", "audit_before_after",
    "audit_round", "cannot_audit", "faulty", "judge", "observed_digest", "render", "run_shell", "size_probe",
    "to_json", "warm_and_cold",
]  # fmt: skip


async def warm_and_cold(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    colds: int,
    *,
    warm_salt: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[tuple[Sample, ...], tuple[Sample, ...]]:
    """Straight to a server: two warm runs in ``warm_salt``'s namespace (the server's default when None),
    so the second hits the cache, then ``colds`` runs, each in a fresh namespace; HEADERS on each."""
    warm = [await complete(http, url, model, prompt, cache_salt=warm_salt, headers=headers) for _ in range(2)]
    cold = [
        await complete(http, url, model, prompt, cache_salt=cold_salt(), headers=headers)
        for _ in range(colds)
    ]
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
    headers: Mapping[str, str] | None = None  # sent with every request (the rollout gate's marker)

    async def replicas(self, http: aiohttp.ClientSession) -> list[str]:
        return list(self.urls)

    async def context(self, http: aiohttp.ClientSession, replica: str) -> int | None:
        return (await fetch_model_list(http, replica)).max_model_len

    async def count_tokens(self, http: aiohttp.ClientSession, replica: str, prompt: str) -> int:
        sample = await complete(
            http, replica, self.model, prompt, max_tokens=1, cache_salt=cold_salt(), headers=self.headers
        )
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
        """Healthy replicas, those kvgate holds to be another base for the logical ID last."""
        healthy = [r for r in await self._replica_view(http) if r["healthy"]]
        return [r["url"] for r in sorted(healthy, key=lambda r: self.logical_id in _mismatches(r))]

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
        status = await self.status(http)
        seen: dict[str, Any] = next((r for r in status["replicas"] if r["url"] == replica), {})
        version = status["versions"].get(self.logical_id, {})
        other_base = _mismatches(seen).get(self.logical_id)
        if other_base is not None:  # kvgate will not serve it there: nothing to sample
            return Observation(
                replica, version.get("name", self.logical_id), version.get("digest"), None, None, (), (),
                seen.get("base_print"), version.get("base_print"), str(other_base),
            )  # fmt: skip
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
            tuple(warm), tuple(cold), seen.get("base_print"), version.get("base_print"),
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


def _mismatches(replica_view: Mapping[str, Any]) -> dict[str, Any]:
    """Logical ID -> why kvgate holds this replica (a ``/kvgate/status`` entry) to be another base."""
    found = replica_view.get("base_mismatch")
    return found if isinstance(found, dict) else {}


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
