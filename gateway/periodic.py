"""Background loops that survive their expected errors but never a cancellation, and the task running one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)


async def periodically(
    interval: float,
    step: Callable[[], Awaitable[None]],
    *,
    survive: tuple[type[Exception], ...] = (),
    on_error: Callable[[Exception], None] = lambda exc: None,
) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled; ``survive`` errors go to ``on_error``.

    Some client libraries turn a cancellation that lands mid-call into their own timeout or
    connection error; if this task is being cancelled, that error ends the loop as a cancellation.
    """
    while True:
        try:
            await step()
        except survive as exc:
            raise_if_cancelling(exc)
            on_error(exc)
        raise_if_cancelling()
        await asyncio.sleep(interval)


def raise_if_cancelling(cause: BaseException | None = None) -> None:
    """Re-raise a cancellation of the current task that a library swallowed or turned into an error."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from cause


@contextlib.asynccontextmanager
async def background(work: Awaitable[None]) -> AsyncIterator[None]:
    """Run ``work`` beside the block; a failure is logged at once (never silent); the end cancels it."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_log_failure)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed and stopped: %r", task.exception(), exc_info=task.exception())
