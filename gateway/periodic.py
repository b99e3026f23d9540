"""Background loops that survive their expected errors but never a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


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
