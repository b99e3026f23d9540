"""Generated blocks in README.md and docs/: which command wrote a block, when, and at which tree.

A block starts with one marker line and ends with another::

    <!-- generated-start | command: python -m loadtest.scale --ids 20000 | date: ... | tree: 84c4c71 -->
    ...what the command wrote...
    <!-- generated-end -->

The fields: ``command`` (a ``make TARGET`` or a ``python -m MODULE ...`` run from the repository root),
then either ``date`` and ``tree`` (a measurement: when, at which commit, with ``+ uncommitted changes``
when the work tree differed from it) or ``checked`` (a deterministic file a test compares with its
generator on every run). Any other field (``load``: the load average) is free text. ``write_block``
replaces the block its own module wrote (or adds one), so a doc can hold prose around generated figures
and several generators' blocks; tests/project/test_docs.py checks every block names a command that exists.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

START = "<!-- generated-start"
END = "<!-- generated-end -->"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Block:
    fields: dict[str, str]
    body: str
    line: int  # of the start marker, from 1

    @property
    def command(self) -> str:
        return self.fields.get("command", "")


def marker(fields: dict[str, str]) -> str:
    cells = [f"{key}: {value}" for key, value in fields.items()]
    if any("|" in cell or "-->" in cell for cell in cells):
        raise ValueError(f"a marker field cannot hold '|' or '-->': {fields}")
    return " | ".join([START, *cells]) + " -->"


def _fields(line: str) -> dict[str, str]:
    inner = line.strip().removeprefix(START).removesuffix("-->")
    fields: dict[str, str] = {}
    for cell in inner.split("|"):
        key, sep, value = cell.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def blocks(text: str) -> list[Block]:
    """Every generated block of a markdown text; ValueError on a start without its end (or the reverse)."""
    found: list[Block] = []
    opened: tuple[int, dict[str, str], list[str]] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith(START):
            if opened is not None:
                raise ValueError(f"line {number}: a block starts inside the block of line {opened[0]}")
            opened = (number, _fields(line), [])
        elif line.strip() == END:
            if opened is None:
                raise ValueError(f"line {number}: {END} without a start")
            found.append(Block(opened[1], "\n".join(opened[2]), opened[0]))
            opened = None
        elif opened is not None:
            opened[2].append(line)
    if opened is not None:
        raise ValueError(f"line {opened[0]}: a generated block without {END}")
    return found


def make_recipe(target: str) -> str | None:
    """The recipe of ``target`` in the repository's Makefile (its lines joined), None if it has none."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    for number, line in enumerate(lines):
        if line.split(":", 1)[0].strip() == target and ":" in line and not line.startswith(("\t", "#")):
            recipe = []
            for body in lines[number + 1 :]:
                if not body.startswith("\t"):
                    break
                recipe.append(body.strip().removesuffix("\\"))
            return " ".join(recipe)
    return None


def module_of(command: str) -> str | None:
    """``loadtest.scale`` for ``[.venv/bin/]python -m loadtest.scale ...``, or for ``make TARGET`` whose
    recipe runs ``-m loadtest.scale``; None for any other command."""
    words = shlex.split(command)
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m":
        return words[2]
    if len(words) >= 2 and words[0] == "make":
        recipe = make_recipe(words[1]) or ""
        parts = recipe.split()
        modules = [parts[i + 1] for i, part in enumerate(parts[:-1]) if part == "-m"]
        return modules[0] if modules else None
    return None


DOCS = (":!docs", ":!README.md")  # what a run writes: never part of what it measures


def tree() -> str:
    """The commit the work tree is at (short), and whether its code differs from it (docs aside)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", ".", *DOCS],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} + uncommitted changes" if dirty else head


@functools.cache
def started_tree() -> str:
    """The tree at this process's first call (a generator makes it before it runs): the code measured."""
    return tree()


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def this_command() -> str:
    """The command line this process runs, as ``python -m MODULE ARGS`` (from the repository root)."""
    main = sys.modules["__main__"]
    module = main.__spec__.name if main.__spec__ is not None else Path(sys.argv[0]).stem
    return shlex.join([".venv/bin/python", "-m", module, *sys.argv[1:]])


def measured(
    body: str, *, command: str | None = None, tree_: str | None = None, at: str | None = None
) -> str:
    """A measurement's block: the marker (command, date, tree, load) and a line that says them."""
    fields = {
        "command": command or this_command(),
        "date": at or now(),
        "tree": tree_ or started_tree(),
        "load": load(),
    }
    said = (
        f"*Generated by `{fields['command']}` on {fields['date']} at tree `{fields['tree']}` "
        f"(load average at the end {fields['load']}).*"
    )
    return f"{marker(fields)}\n{said}\n\n{body.strip()}\n{END}"


def checked(body: str, *, command: str, test: str) -> str:
    """A deterministic block: the marker names the command and the test that compares it on every run."""
    return f"{marker({'command': command, 'checked': test})}\n{body.strip()}\n{END}"


def with_block(text: str, block: str) -> str:
    """``text`` with ``block`` in place of the block of the same module (or command), else appended."""
    (new,) = blocks(block)
    mine = module_of(new.command) or new.command
    lines = text.splitlines()
    for old in blocks(text):
        if (module_of(old.command) or old.command) == mine:
            start = old.line - 1
            end = next(i for i in range(start, len(lines)) if lines[i].strip() == END)
            return "\n".join([*lines[:start], block, *lines[end + 1 :]]) + "\n"
    return (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"


def write_block(path: Path, block: str) -> None:
    """Write ``block`` into the doc at ``path`` (created if missing): see ``with_block``."""
    path.write_text(with_block(path.read_text() if path.exists() else "", block))


def write_report(path: Path, report: str, command: str | None = None) -> None:
    """A generator's whole report as a measured block of ``path``: a leading ``# title`` line stays
    outside the block (it heads a new file; an existing file keeps its own)."""
    title, _, body = report.partition("\n") if report.startswith("# ") else ("", "", report)
    text = path.read_text() if path.exists() else (f"{title}\n" if title else "")
    path.write_text(with_block(text, measured(body, command=command)))
