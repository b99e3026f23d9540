"""Plot the rows ``loadtest.scale`` printed (several runs' output files): docs/scale.png.

    .venv/bin/python -m loadtest.scale_plot docs/scale.png docs/scale.md   (or several runs' output)

The first row of each (path, kvgates, IDs) wins; columns as in ``loadtest.scale.HEADER``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SENT_IDLE, CPU_BUSY, P99 = 4, 8, 10  # columns of a row
PANELS = (
    (SENT_IDLE, "commands sent per kvgate per s, no changes"),
    (CPU_BUSY, "Redis CPU % of a core, 10 changes/s"),
    (P99, "publish -> all converged p99, ms"),
)


def rows(paths: list[Path]) -> list[list[str]]:
    found: dict[tuple[str, str, str], list[str]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith(("| new", "| old")):
                cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
                found.setdefault((cells[0], cells[1], cells[2]), cells)
    return list(found.values())


def number(cell: str) -> float:
    """A figure of the table; '-' (nothing measured, e.g. no publish converged) is not drawn."""
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return float("nan")


def main(out: Path, paths: list[Path]) -> None:
    table = rows(paths)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 4))
    for path, ids in sorted({(row[0], row[2]) for row in table}):
        mine = sorted((row for row in table if (row[0], row[2]) == (path, ids)), key=lambda row: int(row[1]))
        style = ("o" if path == "new" else "s") + ("-" if ids == "100,000" else "--")
        for axis, (column, _) in zip(axes, PANELS, strict=True):
            axis.plot(
                [int(row[1]) for row in mine],
                [number(row[column]) for row in mine],
                style,
                label=f"{path}, {ids} IDs",
            )
    for axis, (_, title) in zip(axes, PANELS, strict=True):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("simulated kvgates")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(arg) for arg in sys.argv[2:]])
