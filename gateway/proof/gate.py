"""The rollout gate: a running rollout is aborted, by kvgate itself, on evidence against its candidate.

Every ``rollout_gate_interval`` seconds, for each logical ID whose rollout runs (the snapshot's
candidates), the gate

1. audits the candidate on each replica eligible for it now (the canary's cold-versus-warm experiment,
   ``Canary.audit_version``; no load is triggered, so a candidate is audited once traffic loaded it), and
2. compares the candidate's error rate with the current version's over this kvgate's own traffic
   (``telemetry.rollout_stats``): once the candidate has served ``rollout_min_requests``, a rate above
   the current one's by more than ``rollout_error_margin`` fails it.

The audit runs beside live traffic. On the real vLLM CPU build, audits run while other adapters'
requests ran were seen off by max |dlogprob| 0.0000 (a few 1e-5) and once 0.0428 (tests/vllm/
test_rollout_vllm.py, before these two rules): below ``rollout_audit_tolerance`` a difference is no fault,
and a fault verdict aborts only when the same replica gives one ``CONFIRM`` rounds in a row (a version
served over another's cache, or other bytes under its name, fail every round, by far more: 1.39 in
``make demo``). An ``incoherent-on-warm-hit`` or ``replica-mismatch`` verdict so confirmed, or that error
rate, aborts the rollout
(``lua/abort_rollout.lua`` with the candidate's digest, so a newer rollout is never the one dropped; any
kvgate's gate may be first, the others find it gone). Each abort is logged, counted
(``kvgate_rollout_gate_aborts_total{reason}``), kept in the history with its reason and, through the
state's ``last_rollout``, shown by every kvgate's ``/kvgate/status`` and status page. ``report`` is what
this kvgate's gate saw of each rollout (its audits, the per-version figures, its state).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.core.errors import KvgateError, RolloutConflict
from gateway.core.model import VersionState
from gateway.core.split import CANDIDATE, CURRENT
from gateway.proof.canary import Canary, describe
from gateway.proof.verdicts import INCOHERENT, MISMATCH, Verdict
from gateway.table.epoch_table import REDIS_DOWN, EpochTable
from gateway.table.rollouts import abort
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.rollout_stats import RolloutStats

log = logging.getLogger(__name__)
ABORTING = (INCOHERENT, MISMATCH)
CONFIRM = 2
"""Rounds in a row a replica must fail the candidate's audit before the gate aborts the rollout."""
ERROR_RATE = "error-rate"


@dataclass(frozen=True, slots=True)
class GateRules:
    error_margin: float  # the candidate's error rate may exceed the current one's by this much
    min_requests: int  # candidate requests before its error rate is judged
    audit_tolerance: float = 0.0  # the audit's smallest logprob tolerance (verdicts.judge's floor)


class Gate:
    def __init__(
        self,
        snapshot: Snapshot,
        table: EpochTable,
        canary: Canary,
        stats: RolloutStats,
        metrics: Metrics,
        rules: GateRules,
    ) -> None:
        self.snapshot = snapshot
        self.table = table
        self.canary = canary
        self.stats = stats
        self.metrics = metrics
        self.rules = rules
        self.audits: dict[str, dict[str, dict[str, Any]]] = {}
        """Logical ID -> replica URL -> the candidate's last verdict there."""
        self.suspects: dict[tuple[str, str, str], int] = {}
        """(logical ID, candidate digest, replica) -> fault verdicts in a row there."""
        self.aborted: dict[str, tuple[str, str, float]] = {}
        """Logical ID -> (candidate digest, why, wall time) of the last rollout this gate aborted."""

    def _running(self) -> dict[str, VersionState]:
        return {s.logical_id: s for s in self.snapshot if s.candidate is not None}

    async def run_round(self) -> None:
        if self.snapshot.flushed:
            return  # never judge from a snapshot that may be incomplete
        running = self._running()
        self.stats.keep({i: s.candidate.digest for i, s in running.items() if s.candidate is not None})
        self.audits = {i: a for i, a in self.audits.items() if i in running}
        self.suspects = {k: n for k, n in self.suspects.items() if k[0] in running}
        for logical_id, state in running.items():
            try:
                await self._judge(state)
            except (KvgateError, aiohttp.ClientError, TimeoutError) as exc:
                log.warning("rollout gate round for %s failed: %s", logical_id, exc)

    async def _judge(self, state: VersionState) -> None:
        candidate = state.candidate_version()
        assert candidate is not None
        if self.aborted.get(state.logical_id, ("",))[0] != candidate.digest:
            self.aborted.pop(state.logical_id, None)  # a new rollout: the last abort is history
        verdicts = await self.canary.audit_version(candidate, self.rules.audit_tolerance)
        seen = self.audits.setdefault(state.logical_id, {})
        for verdict in verdicts:
            seen[verdict.replica] = {**describe(verdict), "digest": candidate.digest}
        failed = self._confirmed(state.logical_id, candidate.digest, verdicts)
        if failed is not None:
            why = f"{failed.verdict} on {failed.replica}: {failed.detail}"
            await self._abort(state, failed.verdict, why)
            return
        figures = self.stats.figures(state.logical_id, candidate.digest)
        cand, cur = figures[CANDIDATE], figures[CURRENT]
        if cand.requests >= self.rules.min_requests and (
            cand.error_rate() > cur.error_rate() + self.rules.error_margin
        ):
            why = (
                f"error rate {cand.error_rate():.1%} over {cand.requests} requests, current "
                f"{cur.error_rate():.1%} over {cur.requests} (margin {self.rules.error_margin:.1%})"
            )
            await self._abort(state, ERROR_RATE, why)

    def _confirmed(self, logical_id: str, digest: str, verdicts: list[Verdict]) -> Verdict | None:
        """A fault verdict on a replica that was faulty in the round before too (``CONFIRM`` rounds in a
        row): one round's fault alone may be the batching of live traffic (see the module's doc)."""
        found = None
        for verdict in verdicts:
            key = (logical_id, digest, verdict.replica)
            if verdict.verdict not in ABORTING:
                self.suspects.pop(key, None)
                continue
            self.suspects[key] = self.suspects.get(key, 0) + 1
            seen = self.suspects[key]
            log.warning("rollout gate: %s's candidate is %s on %s (%d of %d rounds): %s", logical_id,
                        verdict.verdict, verdict.replica, seen, CONFIRM, verdict.detail)  # fmt: skip
            if self.suspects[key] >= CONFIRM and found is None:
                found = verdict
        return found

    async def _abort(self, state: VersionState, reason: str, why: str) -> None:
        assert state.candidate is not None
        name = state.candidate.name
        try:
            await abort(self.table, state.logical_id, f"gate: {why}", digest=state.candidate.digest)
        except RolloutConflict:
            log.info("rollout gate: the rollout of %s (%s) had ended already", state.logical_id, name)
            return
        except REDIS_DOWN as exc:
            log.error("rollout gate: could not abort %s's rollout of %s (retrying): %s",
                      state.logical_id, name, exc)  # fmt: skip
            return
        self.aborted[state.logical_id] = (state.candidate.digest, why, time.time())
        self.metrics.rollout_aborts.labels(self.metrics.for_id(state.logical_id), reason).inc()
        log.error("rollout gate: aborted the rollout of %s to %s: %s", state.logical_id, name, why)

    def report(self) -> dict[str, dict[str, Any]]:
        """Per logical ID with a rollout running (or one this gate aborted): what the gate saw."""
        doc: dict[str, dict[str, Any]] = {}
        for logical_id, state in self._running().items():
            assert state.candidate is not None
            figures = self.stats.figures(logical_id, state.candidate.digest)
            doc[logical_id] = {
                "state": "watching", "audits": self.audits.get(logical_id, {}),
                "figures": {role: f.to_json() for role, f in figures.items()},
                "rules": {"error_margin": self.rules.error_margin, "min_requests": self.rules.min_requests},
            }  # fmt: skip
        for logical_id, (digest, why, at) in self.aborted.items():
            doc.setdefault(logical_id, {})
            doc[logical_id].update({"state": "aborted", "digest": digest, "reason": why, "at": at})
        return doc
