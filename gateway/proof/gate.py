"""The rollout gate: a running rollout is aborted, by kvgate itself, on evidence against its candidate.

Every ``rollout_gate_interval`` seconds, for each logical ID whose rollout runs (the snapshot's
candidates), the gate

1. audits the candidate on each replica eligible for it now (the canary's cold-versus-warm experiment,
   ``Canary.audit_version``; no load is triggered, so a candidate is audited once traffic loaded it), and
2. compares the candidate's error rate with the current version's over this kvgate's own traffic
   (``telemetry.rollout_stats``): once the candidate has served ``rollout_min_requests``, a rate above
   the current one's by more than ``rollout_error_margin`` fails it.

The audit runs beside live traffic. On the real vLLM CPU build, audits run while other adapters'
requests ran were seen off by a max |dlogprob| printed as 0.0000 (under 5e-5) and once by 0.0428
(tests/vllm/test_rollout_vllm.py, before these two rules): below ``rollout_audit_tolerance`` a
difference is no fault,
and a fault verdict counts only when a second audit, run at once, finds the same replica faulty (a
version served over another's cache, or other bytes under its name, fail every audit, by far more: 1.39
in ``make demo``; the copy is quarantined once confirmed, not before). An ``incoherent-on-warm-hit`` or
``replica-mismatch`` verdict so confirmed, or that error rate, aborts the rollout
(``lua/abort_rollout.lua`` with the candidate's digest, so a newer rollout is never the one dropped;
any kvgate's gate may be first, the others find it gone). Each abort is logged, counted
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
        verdicts = await self._audit(candidate)
        suspects = {v.replica for v in verdicts if v.verdict in ABORTING}
        if suspects:  # confirmed by a second audit right away, before anything is quarantined
            for v in (v for v in verdicts if v.replica in suspects):
                log.warning("rollout gate: %s's candidate is %s on %s (auditing it again): %s",
                            state.logical_id, v.verdict, v.replica, v.detail)  # fmt: skip
            verdicts = await self._audit(candidate)
        failed = [v for v in verdicts if v.verdict in ABORTING and v.replica in suspects]
        if failed:
            self.canary.quarantine_faults(failed)  # no request goes to that copy meanwhile
            why = f"{failed[0].verdict} on {failed[0].replica}: {failed[0].detail}"
            await self._abort(state, failed[0].verdict, why)
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

    async def _audit(self, candidate: VersionState) -> list[Verdict]:
        verdicts = await self.canary.audit_version(candidate, self.rules.audit_tolerance, quarantine=False)
        seen = self.audits.setdefault(candidate.logical_id, {})
        for verdict in verdicts:
            seen[verdict.replica] = {**describe(verdict), "digest": candidate.digest}
        return verdicts

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
