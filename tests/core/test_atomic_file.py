"""``write_atomically`` leaves the old file or the new one, never a partial one, and no temporary file.

The failures are real ones: a write that runs out of room half way (a child process whose file size limit,
``RLIMIT_FSIZE``, is below the new file's size: the kernel refuses the rest, as a full disk would) and a
rename that cannot happen (the path is a directory). A reader racing a writer sees only whole files.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway.core.atomic_file import fsync_directory, write_atomically

OLD, NEW = b"old " * 1_000, b"new " * 250_000  # 4 kB, then 1 MB


def test_a_write_replaces_the_file_and_leaves_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    write_atomically(path, OLD)
    assert path.read_bytes() == OLD
    write_atomically(path, NEW)
    assert path.read_bytes() == NEW
    write_atomically(path, b"", durable=False)
    assert path.read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]
    fsync_directory(tmp_path)


WRITE_PAST_THE_LIMIT = """
import resource, signal, sys
from pathlib import Path
from gateway.core.atomic_file import write_atomically

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    write_atomically(Path(sys.argv[1]), b"new " * 250_000)
except OSError as exc:
    print(f"refused: {exc.strerror}")
"""


def test_a_write_that_runs_out_of_room_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    write_atomically(path, OLD)
    done = subprocess.run(
        [sys.executable, "-c", WRITE_PAST_THE_LIMIT, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith("refused: "), done.stdout + done.stderr
    assert path.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"], "the temporary file is gone"


def test_a_rename_that_fails_leaves_no_temporary(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    (taken / "inside").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):  # a rename over a directory that holds something
        write_atomically(taken, NEW)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
    assert [p.name for p in taken.iterdir()] == ["inside"]


def test_a_reader_racing_a_writer_sees_only_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"
    write_atomically(path, OLD)
    stop = threading.Event()
    seen: set[bytes] = set()

    def read() -> None:
        while not stop.is_set():
            seen.add(path.read_bytes())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for round_ in range(200):
            write_atomically(path, NEW if round_ % 2 else OLD, durable=False)
    finally:
        stop.set()
        reader.join(timeout=30)
    assert not reader.is_alive()
    assert seen <= {OLD, NEW}, f"a partial file was read ({sorted(len(s) for s in seen)} bytes)"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]
