"""Checked live: each answer proves (or disproves) what kvgate claimed of the replica that gave it.

kvgate keys precise routing by the tokens it computes; only the replicas' answers can say whether those
are the tokens the replicas compute. Two comparisons per answer, in the request path's account stage,
each a few integers the relay already read (``request.relay.Usage``): no re-tokenizing, O(1) an answer.

- **Token counts.** For a prompt kvgate tokenized whole (its text, tokenized here and not cut at
  ``kv.prompt_tokens.MAX_CHARS``: ``kv.prompt_tokens.Whole``; token ids a client sent prove nothing of
  the tokenizer), the count kvgate computed must equal the answer's ``usage.prompt_tokens``
  (non-streamed answers, and streamed ones with ``stream_options.include_usage``). Every check is
  counted, ``kvgate_token_checks_total{replica,base,result}``, and kept in the replica's window: its last
  ``token_check_window`` checked answers. When more than ``token_check_max_mismatch`` of them disagree
  (once ``MIN_CHECKED`` are in it), that replica is routed on the predicted index
  (``TokenTrust.exact`` is false: the scheduler ignores its KV events), with the reason on ``/healthz``
  (its ``routing`` is ``predicted``) and ``kvgate_token_check_fallback{replica}`` at 1. It returns by
  itself: the check goes on for every answer meanwhile, and once no more than half the bound disagree
  the replica is exact again (the half keeps a rate near the bound from flapping).
- **Precision.** A precise decision claims the replica holds ``matched_blocks`` blocks of the prompt
  (of the replica's block size, by its KV events); the answer's ``cached_tokens``
  (``usage.prompt_tokens_details``, vLLM with ``--enable-prompt-tokens-details``) says how many it
  served from its cache. ``kvgate_prefix_claimed_tokens_total{replica}`` adds the claim and
  ``kvgate_prefix_confirmed_tokens_total{replica}`` the part of it the answer confirmed (at most the
  cached tokens): confirmed / claimed is the precision of kvgate's view of that replica. An answer
  without ``cached_tokens`` confirms nothing and is not counted.

Each kvgate process (each worker) judges the answers it relayed; none asks a peer.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable

from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

MIN_CHECKED = 10
"""Checked answers a window holds before its rate is judged (or the whole window, when smaller): one
early mismatch is no rate."""


class Window:
    """One replica's last ``size`` checked answers: how many disagreed, and whether that passed the
    bound (``distrusted``; judged on every answer added)."""

    __slots__ = ("bound", "distrusted", "mismatched", "results")

    def __init__(self, size: int, bound: float) -> None:
        self.results: deque[bool] = deque(maxlen=size)  # True: the counts disagreed
        self.mismatched = 0
        self.bound = bound
        self.distrusted = False

    def add(self, mismatch: bool) -> bool:
        """One checked answer; True when it changed ``distrusted``."""
        results = self.results
        if len(results) == results.maxlen and results[0]:
            self.mismatched -= 1  # the oldest leaves the window as this one enters
        results.append(mismatch)
        self.mismatched += mismatch
        rate = self.mismatched / len(results)
        if not self.distrusted:
            judged = len(results) >= min(MIN_CHECKED, results.maxlen or MIN_CHECKED)
            self.distrusted = judged and rate > self.bound
            return self.distrusted
        if rate <= self.bound / 2:
            self.distrusted = False
            return True
        return False

    def reason(self) -> str:
        return (
            f"token counts disagree: kvgate's count of {self.mismatched} of the last {len(self.results)} "
            f"prompts it tokenized differs from the replica's usage.prompt_tokens (bound "
            f"{self.bound:g}): kvgate's tokenizer or chat template is not the replica's"
        )

    def health(self) -> dict[str, object]:
        return {"checked": len(self.results), "mismatched": self.mismatched, "fallback": self.distrusted}


class LiveCheck:
    """Every replica's window of token-count checks and its precision counters (``metrics``);
    ``block_size(replica)``: its KV block size (``kv.index.PreciseIndex.block_size``), for claims."""

    def __init__(
        self,
        metrics: Metrics,
        block_size: Callable[[str], int | None],
        *,
        window: int,
        max_mismatch: float,
    ) -> None:
        self.metrics = metrics
        self.block_size = block_size
        self.window = window
        self.max_mismatch = max_mismatch
        self.windows: dict[str, Window] = {}

    def exact(self, replica: str) -> bool:
        """Whether the replica's KV events may route (``core.scheduler.TokenTrust``): its counts agree."""
        window = self.windows.get(replica)
        return window is None or not window.distrusted

    def answered(
        self,
        replica: str,
        base: str,
        *,
        counted: int | None,
        reported: int | None,
        precise_blocks: int,
        cached: int | None,
    ) -> None:
        """One answer of ``replica`` (of base ``base``): ``counted``, kvgate's token count of a prompt it
        tokenized whole (None: not checked); ``reported``, the answer's ``usage.prompt_tokens`` (None: it
        had none); ``precise_blocks``, the blocks a precise decision matched there (0: none claimed);
        ``cached``, the answer's ``cached_tokens`` (None: not reported)."""
        if counted is not None and reported is not None:
            self._check(replica, base, counted != reported)
        if precise_blocks and cached is not None:
            size = self.block_size(replica)
            if size:
                claimed = precise_blocks * size
                metrics = self.metrics
                metrics.child(metrics.prefix_claimed_tokens, replica).inc(claimed)
                metrics.child(metrics.prefix_confirmed_tokens, replica).inc(min(claimed, cached))

    def _check(self, replica: str, base: str, mismatch: bool) -> None:
        metrics = self.metrics
        metrics.child(metrics.token_checks, replica, base, "mismatch" if mismatch else "match").inc()
        window = self.windows.get(replica)
        if window is None:
            window = self.windows[replica] = Window(self.window, self.max_mismatch)
            metrics.token_check_fallback.labels(replica).set_function(functools.partial(_fallback, window))
        if window.add(mismatch):
            if window.distrusted:
                log.warning("replica %s is routed on the predicted index: %s", replica, window.reason())
            else:
                log.info("replica %s: token counts agree again; its KV events route it", replica)

    def health(self, replica: str) -> dict[str, object] | None:
        """For ``/healthz``: the replica's window (None before its first check)."""
        window = self.windows.get(replica)
        return None if window is None else window.health()

    def fallback_reason(self, replica: str) -> str | None:
        """Why the replica is routed on the predicted index by this check (None: it is not)."""
        window = self.windows.get(replica)
        return window.reason() if window is not None and window.distrusted else None


def _fallback(window: Window) -> float:
    return 1.0 if window.distrusted else 0.0
