"""The one retry backoff: capped exponential waits between the tries of something that keeps failing.

``next()`` is the wait before the next try (``first``, then doubling, never above ``cap``), and counts the
failure; ``reset()`` starts over once it works again. The supervisor restarts every background task with one
(the KV followers included) and the workers' parent restarts a crash-looping worker with one::

    backoff = Backoff(first=0.1, cap=5.0)
    await asyncio.sleep(backoff.next())  # 0.1, 0.2, 0.4, ... 5.0, 5.0
    backoff.reset()  # it worked: the next failure waits 0.1 again

No jitter: the tasks that back off are a process's own (one per loop or per replica), not a crowd of clients.
"""

from __future__ import annotations

from dataclasses import dataclass

_DOUBLINGS = 64  # past this the cap holds anyway; 2.0 ** 1024 would raise OverflowError


@dataclass(slots=True)
class Backoff:
    first: float  # seconds before the first retry
    cap: float  # the longest wait
    failures: int = 0  # in a row, since the last ``reset``

    def next(self) -> float:
        """The wait before the next try; counts one more failure."""
        self.failures += 1
        return min(self.cap, self.first * 2.0 ** min(self.failures - 1, _DOUBLINGS))

    def reset(self) -> None:
        """It works again: the next failure waits ``first``."""
        self.failures = 0
