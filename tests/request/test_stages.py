"""The request path's stages: one list, the same in the code (``proxy``'s docstring, ``Proxy.handle``'s
calls) and in docs/architecture.md."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from gateway.request import proxy

STAGE = re.compile(r"^(\d+)\. (\w+): ", re.MULTILINE)
ROOT = Path(__file__).resolve().parents[2]


def stages(text: str) -> list[tuple[int, str]]:
    return [(int(number), name) for number, name in STAGE.findall(text)]


def test_the_stage_list_in_the_code_and_in_the_docs_is_one_list() -> None:
    in_code = stages(proxy.__doc__ or "")
    docs = (ROOT / "docs/architecture.md").read_text()
    section = docs.split("## The request path, in stages\n", 1)[1].split("\n## ", 1)[0]
    assert in_code == stages(section)
    assert [name for _, name in in_code] == [
        "authorize", "parse", "resolve", "split", "tokenize", "decide", "forward", "relay", "account"
    ]  # fmt: skip
    assert [number for number, _ in in_code] == list(range(1, len(in_code) + 1))


def test_handle_calls_the_stages_in_their_order() -> None:
    marks = re.findall(r"# (\d+) (\w+)", inspect.getsource(proxy.Proxy.handle))
    named = [(int(number), name) for number, name in marks]
    listed = dict(stages(proxy.__doc__ or ""))
    assert named, "handle marks each stage's call"
    assert all(listed[number] == name for number, name in named)
    assert [number for number, _ in named] == sorted(number for number, _ in named)
