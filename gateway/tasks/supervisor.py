"""Background work: loops that survive their expected errors (``periodically``), and the one supervisor
every background task runs under (``Supervisor``).

``periodically`` runs a step every interval; the errors it is told to ``survive`` (a Redis outage, which
the loop answers itself: the snapshot is flushed, leases are trusted locally) go to its ``on_error``; any
other error ends the loop, and its supervisor restarts it.

One ``Supervisor`` per process, passed in (``app[SUPERVISOR]``; ``kvgate serve`` makes it and hands it to
the embedded Redis too). A task runs beside a block::

    async with supervisor.run("replica-poll", lambda: pool.poll_forever(...), period=settings.poll_interval):
        ...  # the block's end cancels the task and waits for it

``factory`` makes a fresh coroutine for each (re)start. A cancellation ends the task; any other exception
(and a return: a background task runs until cancelled) restarts it after a capped exponential backoff
(``tasks.backoff``: ``BACKOFF_FIRST_S`` doubling, at most ``max(BACKOFF_MAX_S, period)``). A burst of
failures ends when the task works again: for a loop built on ``periodically``, when one of its steps ends
without an error it cannot answer itself (each step reports to the supervised task it runs in; a step
that runs until cancelled, a subscriber, reports each round it makes with ``progressed``); for a task
that never reported a step, once a run has lasted a whole ``period`` without failing. (Time alone would
not do for a loop: a step that takes longer than the period to fail, a call that times out, would end its
burst at every try and never count as failing.) A task made of several loops (a TaskGroup of
``periodically``) counts failure per loop: a loop whose step failed is *broken* until that loop completes
a step again, and the burst ends only once no loop is broken, so a sibling's steps never hide a loop that
keeps failing. The backoff then starts over. A burst is logged once (its first failure, with the
traceback; its end, "running again"), and every restart is counted (``restarts``, exported as
``kvgate_background_restarts_total{task}``).

A task whose burst has lasted longer than ``failure_limit`` x its period is *failing*: ``failing()``
names it with its last error (``/healthz`` answers 503 with that reason) until it works again (above).
A ``fatal`` task that is failing makes the process useless: ``fatal_reason`` is set and ``wait_fatal``
returns it (``kvgate serve`` then exits 1). A task that is not ``required`` (a replica's KV events: the
predicted index routes while they fail) is restarted, counted and shown the same way, but its failing
never fails readiness: ``failing()`` leaves it out, ``health()`` shows how long it has been failing.

Task names are the label values of the restart counter: a fixed set (one per loop, or one per
configured replica), never anything a client or Redis chooses.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.tasks.backoff import Backoff

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
DEFAULT_FAILURE_LIMIT = 5.0  # periods (Settings.background_failure_limit)
RUNNING, RESTARTING = "running", "restarting"
MESSAGE_CHARS = 300  # of an error's first line, on /healthz and in the readiness reason


@dataclass
class TaskState:
    """One supervised task, as ``/healthz`` shows it."""

    name: str
    period: float
    fatal: bool
    backoff: Backoff  # before each restart of the current burst; reset when the burst ends
    required: bool = True  # its failing fails readiness (``failing``)
    expected: tuple[type[BaseException], ...] = ()  # failures logged in one line, without a traceback
    state: str = RUNNING
    since: float = 0.0  # wall-clock seconds: when it entered ``state``
    restarts: int = 0
    error_type: str | None = None  # the last failure's
    error_message: str | None = None
    failing_since: float | None = None  # monotonic: the current burst's first failure (None: no burst)
    unready_logged: bool = False  # this burst's readiness failure was logged
    steps: bool = False  # it reports its steps (``periodically``): only a step ends a burst
    broken: set[str] = field(default_factory=set)  # its loops whose last step failed (by step name)

    def worked(self) -> None:
        """The burst, if any, is over: the task did its work again."""
        if self.failing_since is not None:
            log.info(
                "background task %s running again after %d failure(s) in %.1f s",
                self.name, self.burst, self.failing_for(time.monotonic()),
            )  # fmt: skip
        self.failing_since, self.unready_logged = None, False
        self.backoff.reset()

    @property
    def burst(self) -> int:
        """Failures in the current burst."""
        return self.backoff.failures

    def stepped(self, loop: str) -> None:
        """LOOP completed a step: the burst is over once no loop of this task is broken."""
        self.broken.discard(loop)
        if not self.broken:
            self.worked()

    def failing_for(self, now: float) -> float:
        return 0.0 if self.failing_since is None else now - self.failing_since

    def doc(self, now: float) -> dict[str, Any]:
        error = None if self.error_type is None else {"type": self.error_type, "message": self.error_message}
        return {
            "state": self.state,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds"),
            "restarts": self.restarts,
            "last_error": error,
            "failing_for_s": round(self.failing_for(now), 1) if self.failing_since is not None else None,
        }


_RUNNING: contextvars.ContextVar[TaskState] = contextvars.ContextVar("kvgate_supervised_task")
"""The supervised task the current code runs in (set in the task's own context)."""
_LOOP: contextvars.ContextVar[str] = contextvars.ContextVar("kvgate_periodic_loop")
"""The ``periodically`` loop the current code runs in (its step's name; set in the loop's own task)."""


class Supervisor:
    def __init__(self, *, failure_limit: float = DEFAULT_FAILURE_LIMIT) -> None:
        self.failure_limit = failure_limit
        """Periods a task may keep failing before it counts as failing (readiness 503, or fatal)."""
        self.tasks: dict[str, TaskState] = {}
        self.fatal_reason: str | None = None
        self._fatal = asyncio.Event()

    @contextlib.asynccontextmanager
    async def run(
        self,
        name: str,
        factory: Callable[[], Awaitable[None]],
        *,
        period: float,
        fatal: bool = False,
        required: bool = True,
        expected: tuple[type[BaseException], ...] = (),
    ) -> AsyncIterator[TaskState]:
        """Run ``factory()`` beside the block, restarted whenever it fails; the block's end cancels it.
        A failure of an ``expected`` type (the outside world's: a replica without events) is logged
        without its traceback, which would say nothing its message does not."""
        if name in self.tasks:
            raise ValueError(f"a background task named {name!r} already runs")
        backoff = Backoff(BACKOFF_FIRST_S, max(BACKOFF_MAX_S, period))
        state = TaskState(name, period, fatal, backoff, required or fatal, expected, since=time.time())
        self.tasks[name] = state
        task = asyncio.create_task(self._supervise(state, factory), name=f"kvgate:{name}")
        try:
            yield state
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            del self.tasks[name]

    async def _supervise(self, state: TaskState, factory: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            ended_burst = loop.call_later(state.period, self._ran_a_period, state)
            try:
                # its own task: a TaskGroup inside that fails leaves its parent's cancel count raised
                # (Python 3.11), which must not read as this task being cancelled
                context = contextvars.copy_context()
                context.run(_RUNNING.set, state)  # its steps report to this state
                await context.run(asyncio.ensure_future, factory())  # the task runs in a copy of it
                error: Exception = RuntimeError("it returned (a background task runs until cancelled)")
            except Exception as exc:  # a cancellation (BaseException) ends it
                error = exc
            finally:
                ended_burst.cancel()
            raise_if_cancelling(error)  # a library turned this task's cancellation into an error
            await asyncio.sleep(self._failed(state, error))
            if self._over_limit(state) and state.required:
                if state.fatal:
                    self._end_process(state)
                    return
                if not state.unready_logged:  # once per burst, like the failure itself
                    log.error("%s: /healthz answers 503 until it runs again", self._reason(state))
                    state.unready_logged = True
            state.state, state.since = RUNNING, time.time()

    def _failed(self, state: TaskState, error: Exception) -> float:
        """Record a failure; the backoff before the restart."""
        cause = _leaf(error)
        lines = str(cause).strip().splitlines() or [""]  # the full error is in the log, with its traceback
        state.error_type, state.error_message = type(cause).__name__, lines[0].rstrip(" :")[:MESSAGE_CHARS]
        state.restarts += 1
        wait = state.backoff.next()
        state.state, state.since = RESTARTING, time.time()
        if state.failing_since is None:
            state.failing_since = time.monotonic()
            log.error(
                "background task %s failed, restarting it with backoff (logged once until it runs again): "
                "%s: %s", state.name, state.error_type, state.error_message,
                exc_info=None if isinstance(cause, state.expected) else error,
            )  # fmt: skip
        else:
            log.debug("background task %s failed again (%d in a row): %r", state.name, state.burst, cause)
        return wait

    def _ran_a_period(self, state: TaskState) -> None:
        if not state.steps:  # a loop's burst ends at its next good step instead
            state.worked()

    def _over_limit(self, state: TaskState) -> bool:
        return state.failing_for(time.monotonic()) > self.failure_limit * state.period

    def _end_process(self, state: TaskState) -> None:
        self.fatal_reason = f"{self._reason(state)}; this process cannot work without it"
        log.critical("kvgate is stopping: %s", self.fatal_reason)
        self._fatal.set()

    def _reason(self, state: TaskState) -> str:
        return (
            f"background task {state.name} has been failing for {state.failing_for(time.monotonic()):.1f} s "
            f"({state.burst} failure(s) in a row, restarted with backoff): "
            f"{state.error_type}: {state.error_message}"
        )

    def failing(self) -> list[str]:
        """Why readiness fails: each required task failing for longer than its limit, with its last error."""
        return [self._reason(state) for state in self._failing()]

    def health(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        return {name: state.doc(now) for name, state in sorted(self.tasks.items())}

    def restart_counts(self) -> dict[str, int]:
        return {name: state.restarts for name, state in self.tasks.items()}

    def failing_tasks(self) -> list[str]:
        """The names of the tasks ``failing`` gives reasons for (what anonymous ``/healthz`` shows)."""
        return [state.name for state in self._failing()]

    def _failing(self) -> list[TaskState]:
        return [state for state in self.tasks.values() if state.required and self._over_limit(state)]

    async def wait_fatal(self) -> str:
        """Until a fatal task is failing; its reason."""
        await self._fatal.wait()
        assert self.fatal_reason is not None
        return self.fatal_reason


def _leaf(error: BaseException) -> BaseException:
    """A TaskGroup's first failure, out of its group (what a reader of /healthz wants to see)."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


async def periodically(
    interval: float,
    step: Callable[[], Awaitable[None]],
    *,
    survive: tuple[type[Exception], ...] = (),
    on_error: Callable[[Exception], None] = lambda exc: None,
) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled; ``survive`` errors go to ``on_error``.
    Each step that ends (done, or with an error it survives) tells the supervised task this loop runs in
    that it works: that ends a burst of failures (``Supervisor``).

    Some client libraries turn a cancellation that lands mid-call into their own timeout or
    connection error; if this task is being cancelled, that error ends the loop as a cancellation.
    """
    supervised = _RUNNING.get(None)
    loop = getattr(step, "__qualname__", repr(step))
    _LOOP.set(loop)  # this task's own context: a sibling loop sets its own
    if supervised is not None:
        supervised.steps = True
    while True:
        try:
            await step()
        except survive as exc:
            raise_if_cancelling(exc)
            on_error(exc)
        except Exception:
            if supervised is not None:  # until this loop steps again, its siblings' steps end no burst
                supervised.broken.add(loop)
            raise
        raise_if_cancelling()
        progressed()  # a step done, or an error the loop answers itself: it works
        await asyncio.sleep(interval)


def progressed() -> None:
    """The ``periodically`` loop this runs in works: a step that runs until cancelled (a subscriber)
    calls it at each round, as ``periodically`` does at the end of each step."""
    supervised, loop = _RUNNING.get(None), _LOOP.get(None)
    if supervised is not None and loop is not None:
        supervised.stepped(loop)


def raise_if_cancelling(cause: BaseException | None = None) -> None:
    """Re-raise a cancellation of the current task that a library swallowed or turned into an error."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from cause
