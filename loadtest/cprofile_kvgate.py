"""``kvgate`` under cProfile with a CPU-time clock, switched on and off by signals.

``python -m loadtest.cprofile_kvgate OUT.pstats serve ...`` runs ``gateway.cli.main`` with the remaining
arguments. SIGUSR1 starts profiling, SIGUSR2 stops it and writes ``OUT.pstats``. The clock is
``time.process_time`` (user + system CPU of this process), so time spent blocked in ``epoll_wait`` or
waiting for a core on a busy machine is not counted, unlike a wall-clock sampler. cProfile's own
overhead inflates Python-heavy code; read the shares, not the absolute times.
"""

from __future__ import annotations

import cProfile
import signal
import sys
import time
from types import FrameType

from gateway.cli import main as kvgate_main


def run(out: str, argv: list[str]) -> int:
    profiler = cProfile.Profile(time.process_time)

    def start(signum: int, frame: FrameType | None) -> None:
        profiler.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return kvgate_main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m loadtest.cprofile_kvgate OUT.pstats serve [kvgate options]")
    sys.exit(run(sys.argv[1], sys.argv[2:]))
