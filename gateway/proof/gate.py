"""The rollout gate: a running rollout is aborted, by kvgate itself, on evidence against its candidate.

**One gate per rollout per interval, on the fleet's figures** (``table/rollout_gate.py``). Every worker of
every kvgate ticks (``tick_of``: a quarter of ``rollout_gate_interval``, at most 1 s). At each tick, for
each logical ID whose rollout runs (the snapshot's candidates), it adds what its own traffic counted
since its last tick to the rollout's fleet-wide figures in Redis and asks for the rollout's turn: one
kvgate process holds the rollout's gate (a lease of ``lease_s``, three intervals, taken over when its
holder stops asking) and only it judges:

1. the fleet's figures at every tick: once the candidate has served ``rollout_min_requests`` fleet-wide,
   an error rate above the current version's by more than ``rollout_error_margin`` fails it; and a
   candidate whose every request failed, ``failing_requests`` (3) of them fleet-wide, while the current
   version answers, fails at once (one that cannot load: another base, a broken file); and
2. once per interval, fleet-wide (the round's start is kept beside the lease), it audits the candidate
   on each replica eligible for it now (the canary's cold-versus-warm experiment,
   ``Canary.audit_version``; no load is triggered, so a candidate is audited once traffic loaded it).
   Each audit request says who sent it and in which round (``x-kvgate-audit``).

The audit runs beside live traffic. On the real vLLM CPU build, audits run while other adapters'
requests ran were seen off by a max |dlogprob| printed as 0.0000 (under 5e-5) and once by 0.0428
(tests/vllm/test_rollout_vllm.py, before these two rules): below ``rollout_audit_tolerance`` a
difference is no fault,
and a fault verdict counts only when a second audit, run at once, finds the same replica faulty (a
version served over another's cache, or other bytes under its name, fail every audit, by far more: 1.39
in ``make demo``; the copy is quarantined once confirmed, not before). An ``incoherent-on-warm-hit`` or
``replica-mismatch`` verdict so confirmed, or those figures, abort the rollout
(``lua/abort_rollout.lua`` with the candidate's digest, so a newer rollout is never the one dropped).
Each abort is logged, counted (``kvgate_rollout_gate_aborts_total{reason}``), kept in the history with
its reason and, through the state's ``last_rollout``, shown by every kvgate's ``/kvgate/status`` and
status page. ``report`` is what this worker saw of each rollout: who holds its gate, the fleet's figures
and its own, the holder's audits (when this worker holds it), its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.core.errors import KvgateError, RolloutConflict
from gateway.core.model import VersionState
from gateway.core.split import CANDIDATE, CURRENT
from gateway.core.wire import AUDIT_HEADER
from gateway.proof.canary import Canary, describe
from gateway.proof.verdicts import INCOHERENT, MISMATCH, Verdict
from gateway.table.epoch_table import REDIS_DOWN, EpochTable
from gateway.table.rollout_gate import GateTable, Turn
from gateway.table.rollouts import abort
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.rollout_stats import RolloutStats, VersionFigures

log = logging.getLogger(__name__)
ABORTING = (INCOHERENT, MISMATCH)
ERROR_RATE = "error-rate"
FAILING = "failing"
LEASE_INTERVALS = 3
"""A gate's lease lasts this many intervals: its holder renews it at every tick, and at the same pace while
its audit round runs (a round may take longer), so only a holder that died (or hangs) loses it."""


def tick_of(interval: float) -> float:
    """Seconds between a worker's gate ticks: a quarter of the interval, at most 1 s."""
    return min(interval / 4, 1.0)


@dataclass(frozen=True, slots=True)
class GateRules:
    error_margin: float  # the candidate's error rate may exceed the current one's by this much
    min_requests: int  # candidate requests (fleet-wide) before its error rate is judged
    audit_tolerance: float = 0.0  # the audit's smallest logprob tolerance (verdicts.judge's floor)
    failing_requests: int = 3  # candidate requests, all failed fleet-wide, that fail it at once


class Gate:
    def __init__(
        self,
        snapshot: Snapshot,
        table: EpochTable,
        canary: Canary,
        stats: RolloutStats,
        metrics: Metrics,
        rules: GateRules,
        shared: GateTable,
    ) -> None:
        self.snapshot = snapshot
        self.table = table
        self.canary = canary
        self.stats = stats
        self.metrics = metrics
        self.rules = rules
        self.shared = shared
        self.audits: dict[str, dict[str, dict[str, Any]]] = {}
        """Logical ID -> replica URL -> the candidate's last verdict there (when this worker audited it)."""
        self.turns: dict[str, Turn] = {}
        """Logical ID -> who held its rollout's gate at this worker's last tick."""
        self.fleet: dict[str, dict[str, VersionFigures]] = {}
        """Logical ID -> its rollout's fleet-wide figures at this worker's last tick."""
        self.aborted: dict[str, tuple[str, str, float]] = {}
        """Logical ID -> (candidate digest, why, wall time) of the last rollout this gate aborted."""

    def _running(self) -> dict[str, VersionState]:
        return {s.logical_id: s for s in self.snapshot if s.candidate is not None}

    async def run_round(self) -> None:
        """One tick: this worker's counts shared, the turn asked for, and the holder's judgement."""
        if self.snapshot.flushed:
            return  # never judge from a snapshot that may be incomplete
        running = self._running()
        self.stats.keep({i: s.candidate.digest for i, s in running.items() if s.candidate is not None})
        for kept in (self.audits, self.turns, self.fleet):
            for logical_id in [i for i in kept if i not in running]:
                del kept[logical_id]
        for logical_id, state in running.items():
            try:
                await self._tick(state)
            except (KvgateError, aiohttp.ClientError, TimeoutError, *REDIS_DOWN) as exc:
                log.warning("rollout gate tick for %s failed: %s", logical_id, exc)

    async def _tick(self, state: VersionState) -> None:
        candidate = state.candidate_version()
        assert candidate is not None
        logical_id, digest = state.logical_id, candidate.digest
        if self.aborted.get(logical_id, ("",))[0] != digest:
            self.aborted.pop(logical_id, None)  # a new rollout: the last abort is history
        taken = self.stats.take_pending(logical_id, digest)
        try:
            await self.shared.add(logical_id, digest, taken)
        except BaseException:
            self.stats.give_back(logical_id, digest, taken)  # added at the next tick instead
            raise
        turn = self.turns[logical_id] = await self.shared.take_turn(logical_id, digest)
        figures = self.fleet[logical_id] = await self.shared.figures(logical_id, digest)
        if not turn.mine:
            self.audits.pop(logical_id, None)  # another process's gate audits it now
            return
        if await self._judge_figures(state, figures) or not turn.due:
            return
        headers = {AUDIT_HEADER: f"{self.shared.gateway_id} round {turn.round_ms}"}
        async with self._holding(logical_id, digest):
            verdicts = await self._audit(candidate, headers)
            suspects = {v.replica for v in verdicts if v.verdict in ABORTING}
            if suspects:  # confirmed by a second audit right away, before anything is quarantined
                for v in (v for v in verdicts if v.replica in suspects):
                    log.warning("rollout gate: %s's candidate is %s on %s (auditing it again): %s",
                                logical_id, v.verdict, v.replica, v.detail)  # fmt: skip
                verdicts = await self._audit(candidate, headers)
        failed = [v for v in verdicts if v.verdict in ABORTING and v.replica in suspects]
        if failed:
            self.canary.quarantine_faults(failed)  # no request goes to that copy meanwhile
            why = f"{failed[0].verdict} on {failed[0].replica}: {failed[0].detail}"
            await self._abort(state, failed[0].verdict, why)

    @contextlib.asynccontextmanager
    async def _holding(self, logical_id: str, digest: str) -> AsyncIterator[None]:
        """This worker's lease on the gate, renewed every tick while its audit round runs: its ticks wait
        for the round, which may outlast the lease, and another kvgate would take the gate over mid-round."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(tick_of(self.shared.interval_ms / 1000))
                try:
                    if not await self.shared.renew(logical_id, digest):
                        log.warning("rollout gate: %s's gate was taken over during its audit", logical_id)
                        return
                except (KvgateError, *REDIS_DOWN) as exc:
                    log.warning("rollout gate: could not renew %s's gate while auditing: %s", logical_id, exc)

        renewing = asyncio.create_task(renew())
        try:
            yield
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing

    async def stop(self) -> None:
        """This worker stops: what it counted is shared, and every gate it holds let go of (the next
        asker takes it at its next tick, not a lease later)."""
        for logical_id, state in self._running().items():
            assert state.candidate is not None
            digest = state.candidate.digest
            try:
                await self.shared.add(logical_id, digest, self.stats.take_pending(logical_id, digest))
                turn = self.turns.get(logical_id)
                if turn is not None and turn.mine:
                    await self.shared.release(logical_id, digest)
            except (KvgateError, *REDIS_DOWN) as exc:
                log.warning("rollout gate: could not hand over %s's gate as it stops: %s", logical_id, exc)

    async def _judge_figures(self, state: VersionState, figures: dict[str, VersionFigures]) -> bool:
        """Whether the fleet's figures failed the candidate (the rollout is then aborted)."""
        cand, cur = figures[CANDIDATE], figures[CURRENT]
        current = f"current {cur.error_rate():.1%} over {cur.requests}"
        if cand.requests >= self.rules.failing_requests and cand.errors == cand.requests:
            if cur.requests and cur.errors == cur.requests:
                return False  # both fail: not the candidate's fault alone (replicas down, say)
            why = f"every one of its {cand.requests} requests failed across the fleet ({current})"
            await self._abort(state, FAILING, why)
            return True
        if cand.requests >= self.rules.min_requests and (
            cand.error_rate() > cur.error_rate() + self.rules.error_margin
        ):
            why = (
                f"error rate {cand.error_rate():.1%} over {cand.requests} requests across the fleet, "
                f"{current} (margin {self.rules.error_margin:.1%})"
            )
            await self._abort(state, ERROR_RATE, why)
            return True
        return False

    async def _audit(self, candidate: VersionState, headers: dict[str, str]) -> list[Verdict]:
        verdicts = await self.canary.audit_version(
            candidate, self.rules.audit_tolerance, quarantine=False, headers=headers
        )
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
            own = self.stats.figures(logical_id, state.candidate.digest)
            fleet = self.fleet.get(logical_id)
            turn = self.turns.get(logical_id)
            doc[logical_id] = {
                "state": "watching", "audits": self.audits.get(logical_id, {}),
                "gate": turn.to_json() if turn is not None else None,
                "figures": {role: f.to_json() for role, f in fleet.items()} if fleet is not None else None,
                "own_figures": {role: f.to_json() for role, f in own.items()},
                "rules": {"error_margin": self.rules.error_margin, "min_requests": self.rules.min_requests,
                          "failing_requests": self.rules.failing_requests},
            }  # fmt: skip
        for logical_id, (digest, why, at) in self.aborted.items():
            doc.setdefault(logical_id, {})
            doc[logical_id].update({"state": "aborted", "digest": digest, "reason": why, "at": at})
        return doc
