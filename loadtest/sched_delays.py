"""How long processes wait for a CPU once woken: ``perf sched`` over every CPU for a while, per process.

For each process given (a pid, all its threads), its wake-ups in the window, the run time they got, and
the scheduling delay (wake-up to running) at p99 and at most, with how many waited over 0.5 ms and 1 ms.
docs/edge-parsing.md reads the heavy-bodies benchmark with it: run it while ``loadtest.heavy_bodies``
is in a loaded phase, naming the small requests' stub, the prober and the proxy in between. Needs
``perf`` (Debian's ``linux-perf``) and the rights to record scheduler events (root here).

    .venv/bin/python -m loadtest.sched_delays --seconds 8 PID [PID ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

TASK = re.compile(r"\[(\d+)(?:/(\d+))?\]$")  # perf's "comm[tid]" or "comm[tid/pid]"


def delays(timehist: str, pids: set[int]) -> dict[int, tuple[float, list[float]]]:
    """Run time (ms) and each wake-up's scheduling delay (ms) per pid, from ``perf sched timehist``."""
    found: dict[int, tuple[float, list[float]]] = defaultdict(lambda: (0.0, []))
    for line in timehist.splitlines():
        fields = line.split()
        if len(fields) < 6 or not (task := TASK.search(fields[2])):
            continue
        tid, pid = int(task[1]), int(task[2] or task[1])
        owner = pid if pid in pids else tid
        if owner not in pids:
            continue
        try:
            delay, run = float(fields[-2]), float(fields[-1])
        except ValueError:
            continue
        total, waits = found[owner]
        waits.append(delay)
        found[owner] = (total + run, waits)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.sched_delays", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="how long to record (default 8 s)")
    parser.add_argument("pids", nargs="+", type=int)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sched-") as tmp:
        data = str(Path(tmp) / "perf.data")
        record = ["perf", "sched", "record", "-a", "-o", data, "--", "sleep", str(args.seconds)]
        subprocess.run(record, check=True, capture_output=True)
        timehist = subprocess.run(
            ["perf", "sched", "timehist", "-i", data], check=True, capture_output=True, text=True
        ).stdout
    found = delays(timehist, set(args.pids))
    for pid in args.pids:
        run, waits = found.get(pid, (0.0, []))
        if not waits:
            print(f"{pid}: no wake-up seen")
            continue
        waits.sort()
        p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
        print(
            f"{pid}: ran {run:.0f} ms, {len(waits)} wake-ups, delay p99 {p99:.3f} ms, "
            f"max {waits[-1]:.3f} ms, {sum(w > 0.5 for w in waits)} over 0.5 ms, "
            f"{sum(w > 1 for w in waits)} over 1 ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
