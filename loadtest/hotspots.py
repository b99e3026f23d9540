"""Summarise a py-spy ``--format raw`` profile (collapsed stacks) by where the time goes in ``gateway/``.

Three views, each as a share of all samples of the process:

- inclusive: samples with the function anywhere on the stack;
- attributed: each sample charged to its deepest ``gateway/`` frame (that function plus the library
  code it called), or to "outside gateway/" (the aiohttp server, asyncio);
- self: the leaf frame, whatever module it is in.

``gateway/cli/__main__.py`` and ``gateway/cli/main.py`` (the entry point, under which the event loop runs) do
not count as gateway/ frames.
``python -m loadtest.proxy_overhead --profile`` writes this summary next to its flame graph.

Run: ``python -m loadtest.hotspots PROFILE [--top 15]``.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
OUTSIDE = "outside gateway/ (aiohttp server, asyncio, event loop)"


@dataclass
class Summary:
    total: int
    inclusive: Counter[str]
    attributed: Counter[str]
    leaf: Counter[str]

    def render(self, top: int = 15) -> str:
        if not self.total:
            return "no samples"
        out = [f"{self.total} samples"]
        for title, counter in (
            ("attributed to the deepest gateway/ frame (incl. library code it calls)", self.attributed),
            ("inclusive (gateway/ functions anywhere on the stack)", self.inclusive),
            ("self (leaf frames, any module)", self.leaf),
        ):
            out.append(f"\n{title}:")
            for name, count in counter.most_common(top):
                out.append(f"  {100 * count / self.total:5.1f}%  {name}")
        return "\n".join(out)


def frame_name(frame: str) -> tuple[str, bool]:
    """``func (path:line)`` → (``path-from-gateway:func`` or ``module-file:func``, in gateway/)."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip(), False
    path, func = match["file"], match["func"]
    if path.endswith(("gateway/cli/__main__.py", "gateway/cli/main.py")):  # the entry point: every sample
        return f"{path[path.rfind('gateway/') :]}:{func}", False  # of the event loop runs under it
    if "site-packages" not in path and (path.startswith("gateway/") or "/gateway/" in path):
        return f"{path[path.rfind('gateway/') :]}:{func}", True
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{func}", False


def summarize(text: str) -> Summary:
    total = 0
    inclusive: Counter[str] = Counter()
    attributed: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";")]
        frames = [f for f in frames if not f[0].startswith(("thread (", "process "))]
        if not frames:
            continue
        total += count
        seen = {name for name, in_gateway in frames if in_gateway}
        for name in seen:
            inclusive[name] += count
        deepest = next((name for name, in_gateway in reversed(frames) if in_gateway), OUTSIDE)
        attributed[deepest] += count
        leaf[frames[-1][0]] += count
    return Summary(total, inclusive, attributed, leaf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarize(args.profile.read_text(errors="replace")).render(args.top))


if __name__ == "__main__":
    main()
