"""The snapshot's local file: a kvgate starts from it instead of reading the whole epoch table.

``SnapshotSync`` (snapshot.py) writes it every ``snapshot_file_interval`` when the snapshot moved, and on
start loads it, checks it against Redis and catches up from the change log (``SnapshotSync.reconcile``).
The file holds what the snapshot held at one change-log position: the table's generation, that position,
the checksum (the sum of the rows' hashes), every current version (in columns) and the malformed rows.

Layout: ``MAGIC``, then a 32-byte BLAKE2b of the body, then the body (msgpack, ``FORMAT`` inside it).
A file that is missing, truncated, fails its digest, is not msgpack of the expected shape (``corrupt``)
or of another format version (``foreign``) is never trusted: it is counted
(``kvgate_snapshot_file_total{outcome}``), logged and ignored, and the start reads the table in full.

Writing is atomic for any number of writers sharing one data dir (``kvgate serve --workers``): each
writes a temporary file of its own in the same directory, flushes it to disk, then renames it over the
file (``core.atomic_file.write_atomically``). A reader sees a whole file, old or new, never a partial one;
of two writers the last rename wins, and either file is valid at the position it names.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import functools
import gc
import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from gateway.core.atomic_file import write_atomically
from gateway.core.errors import EpochTableError
from gateway.core.model import WEIGHT_FULL, Candidate, VersionState
from gateway.core.split import SPLIT_KEYS
from gateway.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

MAGIC = b"kvgate-snapshot\n"
FORMAT = 2  # 2: a candidate row holds its split key
DIGEST_BYTES = 32
FILE_NAME = "snapshot.msgpack"
FIELDS = tuple(f.name for f in dataclasses.fields(VersionState))
Malformed = dict[str, str]  # logical ID -> why its state row could not be read


class Rejected(EpochTableError):
    """The file cannot be used; ``outcome`` is the metric's label (corrupt, foreign, generation, ...).
    Never raised past ``SnapshotFile.load``: counted, logged, and the start reads the table in full."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(f"snapshot file: {reason}")
        self.outcome = outcome
        self.reason = reason


@dataclass(frozen=True)
class Saved:
    generation: str
    position: str  # the change-log entry the states are valid at
    checksum: int
    states: dict[str, VersionState]
    malformed: dict[str, str]
    written_at: float  # wall time, for the log line only


def encode(
    generation: str, position: str, checksum: int, states: Iterable[VersionState], malformed: dict[str, str]
) -> bytes:
    rows = list(states)
    columns = [[getattr(state, name) for state in rows] for name in FIELDS if name != "candidate"]
    columns.insert(FIELDS.index("candidate"), [_candidate_row(state.candidate) for state in rows])
    body: bytes = msgpack.packb(
        {"format": FORMAT, "generation": generation, "position": position, "checksum": checksum,
         "written_at": time.time(), "fields": list(FIELDS), "columns": columns, "malformed": malformed},
        use_bin_type=True, unicode_errors="surrogateescape",  # text read from Redis that was not UTF-8
    )  # fmt: skip
    return MAGIC + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() + body


def decode(data: bytes) -> Saved:
    """The file's content, or ``Rejected`` (never another exception) saying why it cannot be trusted."""
    head = len(MAGIC) + DIGEST_BYTES
    if not data.startswith(MAGIC):
        raise Rejected("corrupt", "it does not start with the snapshot file's magic")
    digest, body = data[len(MAGIC) : head], data[head:]
    if len(digest) < DIGEST_BYTES or hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise Rejected("corrupt", "its digest does not match its content (truncated or damaged)")
    with gc_paused():
        try:
            doc = msgpack.unpackb(body, raw=False, unicode_errors="surrogateescape", strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            raise Rejected("corrupt", f"it is not msgpack: {exc}") from exc
        if not isinstance(doc, dict):
            raise Rejected("corrupt", "its body is not a map")
        if doc.get("format") != FORMAT or doc.get("fields") != list(FIELDS):
            raise Rejected(
                "foreign", f"format {doc.get('format')!r}, fields {doc.get('fields')!r}: not {FORMAT}"
            )
        return _saved(doc)


def _saved(doc: dict[str, Any]) -> Saved:
    generation, position, checksum = doc.get("generation"), doc.get("position"), doc.get("checksum")
    columns, malformed, written_at = doc.get("columns"), doc.get("malformed"), doc.get("written_at")
    if not (isinstance(generation, str) and generation and isinstance(position, str) and position):
        raise Rejected("corrupt", "it names no generation or no position")
    if type(checksum) is not int or not isinstance(written_at, float):
        raise Rejected("corrupt", "its checksum or time is not a number")
    if (
        not isinstance(columns, list)
        or len(columns) != len(FIELDS)
        or not all(isinstance(column, list) for column in columns)
    ):
        raise Rejected("corrupt", "its columns are not one list per field")
    if len({len(column) for column in columns}) > 1:
        raise Rejected("corrupt", "its columns differ in length")
    for name, column in zip(FIELDS, columns, strict=True):  # checked at C speed: a join, an int64 array
        if name == "candidate":  # a rollout's candidate (rare): checked row by row
            columns[FIELDS.index(name)] = [_candidate(row) for row in column]
            continue
        try:
            array.array("q", column) if name == "epoch" else "".join(column)
        except (TypeError, OverflowError):
            raise Rejected("corrupt", f"its {name} column holds something of another type") from None
    if not isinstance(malformed, dict) or not all(type(v) is str for v in [*malformed, *malformed.values()]):
        raise Rejected("corrupt", "its malformed rows are not a map of text")
    states = dict(zip(columns[0], map(VersionState, *columns), strict=True))
    if len(states) != len(columns[0]):
        raise Rejected("corrupt", "it names a logical ID twice")
    return Saved(generation, position, checksum, states, malformed, written_at)


def _candidate_row(candidate: Candidate | None) -> list[str | int] | None:
    if candidate is None:
        return None
    c = candidate
    return [c.digest, c.name, c.path, c.base, c.base_print, c.weight, c.split]


def _candidate(row: Any) -> Candidate | None:
    """A rollout candidate as written (None: none); ``Rejected`` when it is not one."""
    if row is None:
        return None
    if not (isinstance(row, list) and len(row) == 7 and all(type(v) is str for v in row[:5])
            and type(row[5]) is int and 0 <= row[5] <= WEIGHT_FULL
            and (row[6] == "" or row[6] in SPLIT_KEYS)):  # fmt: skip
        raise Rejected("corrupt", "its candidate column holds something that is no candidate")
    return Candidate(*row)


def snapshot_file(data_dir: Path, interval: float, metrics: Metrics) -> SnapshotFile | None:
    """The file ``serve`` keeps in DATA_DIR, written every INTERVAL seconds (0: none)."""
    return SnapshotFile(data_dir / FILE_NAME, interval=interval, metrics=metrics) if interval else None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile: a start's million new objects (none of them in a cycle)
    would otherwise set off collections that each walk every object so far, about half the load's CPU."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class SnapshotFile:
    def __init__(self, path: Path, *, interval: float, metrics: Metrics | None = None) -> None:
        self.path = path
        self.interval = interval
        """Seconds between writes (a write only when the snapshot moved since the last one)."""
        self.metrics = metrics
        self.outcomes: dict[str, int] = {}  # what the metric counts, for tests and the scale loadtest
        self.written: tuple[str, str] = ("", "")  # (generation, position) of the last file written or loaded

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if self.metrics is not None:
            self.metrics.snapshot_file.labels(outcome).inc()

    def reject(self, outcome: str, reason: str) -> None:
        self.count(outcome)
        log.warning("not starting from the snapshot file %s (%s): %s; reading the table in full",
                    self.path, outcome, reason)  # fmt: skip

    def load(self) -> Saved | None:
        """The file's content, or None when there is none or it cannot be trusted (counted, logged)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.count("missing")
            return None
        except OSError as exc:
            self.reject("corrupt", f"unreadable: {exc}")
            return None
        try:
            return decode(data)
        except Rejected as exc:
            self.reject(exc.outcome, exc.reason)
            return None

    async def save(
        self, generation: str, position: str, checksum: int, states: list[VersionState], malformed: Malformed
    ) -> None:
        """Encode and write in a thread (the event loop keeps serving); a failed write is counted, logged."""
        data = functools.partial(encode, generation, position, checksum, states, malformed)
        try:
            await asyncio.to_thread(lambda: self.write(data()))
        except (OSError, ValueError, TypeError) as exc:  # a full disk; a row msgpack cannot encode (a bug)
            self.count("write_failed")
            log.error(
                "could not write the snapshot file %s: %s",
                self.path,
                exc,
                exc_info=not isinstance(exc, OSError),
            )
            return
        self.written = (generation, position)
        self.count("written")

    def write(self, data: bytes) -> None:
        """DATA as the file, atomically (``core.atomic_file``: a temporary file of this writer's own, fsynced,
        then renamed)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, data)
