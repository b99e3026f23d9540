"""One ``/metrics`` page from the pages of every ``--workers`` process (Prometheus text format 0.0.4).

Each worker keeps its own registry (``Metrics``, its custom collectors included) and renders it as usual;
the worker that answers a scrape merges its siblings' pages into its own, sample by sample (same name,
same labels): counters, histograms and summaries are **summed** (requests counted by whichever worker
served them), a ``_created`` sample takes the **earliest**, and gauges take the **largest** value. Every
kvgate gauge is a worker's view of a state the workers share (a replica's event lag, its quarantine, the
snapshot's staleness), so the largest is the worst view, which is what an alert should see; a sum would
count one replica once per worker. A series only one worker has (a logical ID in its top K only) is kept
as it is. Families keep the order of their first appearance, samples too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import utils
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_text: Callable[[float], str] = utils.floatToGoString  # as prometheus_client writes values


@dataclass
class _Family:
    kind: str = "untyped"
    comments: list[str] = field(default_factory=list)  # its HELP and TYPE lines, as the first page had them
    samples: dict[str, float] = field(default_factory=dict)  # "name{labels}" -> value


def _combine(kind: str, key: str, old: float, new: float) -> float:
    if key.split("{", 1)[0].endswith("_created"):
        return min(old, new)
    if kind == "gauge":
        return new if math.isnan(old) else old if math.isnan(new) else max(old, new)
    return old + new


def merge_pages(pages: Iterable[bytes]) -> bytes:
    """The pages merged as described above; a line that is not a sample or a comment is dropped."""
    families: dict[str, _Family] = {}
    for page in pages:
        current = _Family()
        for raw in page.decode("utf-8", "replace").splitlines():
            line = raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                    continue
                current = families.setdefault(parts[2], _Family())
                if parts[1] == "TYPE" and len(parts) == 4:
                    current.kind = parts[3]
                if line not in current.comments:
                    current.comments.append(line)
                continue
            key, _, text = line.rpartition(" ")
            try:
                value = float(text)
            except ValueError:
                continue
            if not key:
                continue
            held = current.samples.get(key)
            current.samples[key] = value if held is None else _combine(current.kind, key, held, value)
    out: list[str] = []
    for family in families.values():
        out.extend(family.comments)
        out.extend(f"{key} {_text(value)}" for key, value in family.samples.items())
    return ("\n".join(out) + "\n").encode() if out else b""


_ACCUMULATING = frozenset(("counter", "histogram", "summary"))


def counters_only(page: bytes, drop: tuple[str, ...] = ()) -> bytes:
    """The families of ``page`` that only grow (counters, histograms, summaries, and their ``_created``
    times), without those whose name starts with one of ``drop``: what a worker that has stopped still
    contributes to the sum (its gauges said something only while it ran)."""
    kept: list[str] = []
    family: list[str] = []  # the lines of the family being read, from its first comment
    name, kind = "", ""
    for raw in [*page.decode("utf-8", "replace").splitlines(), "# HELP end-of-page"]:
        parts = raw.split(None, 3)
        if raw.startswith("#") and len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] != name:
            if kind in _ACCUMULATING and not (drop and name.startswith(drop)):
                kept.extend(family)
            family, name, kind = [], parts[2], "untyped"
        if raw.startswith("# TYPE ") and len(parts) == 4:
            kind = "counter" if name.endswith("_created") else parts[3].strip()
        family.append(raw)
    return ("\n".join(kept) + "\n").encode() if kept else b""


class PageCollector:
    """Another process's page (a file it writes) as a collector of this registry: its families, parsed as
    they are read (a page that is missing or does not parse yields nothing). The KV indexer's counters
    and gauges in a one-process kvgate's own registry (with --workers, the page is merged once at the
    scrape instead: in every worker's registry, the merge would count it once per worker)."""

    def __init__(self, path: Callable[[], Path]) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        try:
            text = self.path().read_text()
        except OSError:
            return
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            return
        yield from families
