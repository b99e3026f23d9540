"""README.md and docs/: every generated block names a command that exists (with the flags it accepts), its
date and tree (or the test that checks it); every link and every repository path a page names resolves;
the README stays a front door. Fast: no servers, nothing run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gateway.dev.generated_docs import END, START, blocks, measured, module_of, write_block

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
BENCHMARK_PAGES = ("perf.md", "prefix_routing.md", "scale.md", "edge.md", "chaos.md", "invalidation.md")
D = "date: 2026-12-02 03:00 UTC | tree: 84c4c71"
TREE = re.compile(r"[0-9a-f]{7,40}\b")
DATE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")
REPO_PATH = re.compile(r"`((?:gateway|loadtest|tests|lua|scripts|deploy|docs)/[\w./-]*)(?:::[\w\[\]-]+)?`")
DOTTED = re.compile(r"`(gateway(?:\.\w+)+)")


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([\w.$()/-]+):(?!=)", text, re.MULTILINE)}


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def command_problems(command: str) -> list[str]:
    """Why ``command`` is not one this repository has (empty: it is)."""
    if not command:
        return ["no command"]
    words = shlex.split(command)
    if words[0] == "make":
        if len(words) < 2 or words[1] not in make_targets():
            return [f"no Makefile target {words[1:2]}"]
        makefile = (ROOT / "Makefile").read_text()
        unknown = [w for w in words[2:] if "=" in w and f"$({w.split('=')[0]})" not in makefile]
        return [f"the Makefile reads no variable {w.split('=')[0]}" for w in unknown]
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m":
        source = module_file(words[2])
        if source is None:
            return [f"no module {words[2]}"]
        text = source.read_text()
        flags = [w.split("=")[0] for w in words[3:] if w.startswith("--")]
        return [f"{words[2]} takes no {flag}" for flag in flags if f'"{flag}"' not in text]
    return [f"neither `make TARGET` nor `python -m MODULE`: {command}"]


OTHER_MARKER = re.compile(  # an old kind of marker: chaos:start, settings-table:end, "Generated from ..."
    r"^<!--\s*(?:[\w-]+:(?:start|end)|[Gg]enerated\b(?!-(?:start|end)\b)).*", re.MULTILINE
)


def block_problems(text: str) -> list[str]:
    try:
        found = blocks(text)
    except ValueError as exc:
        return [str(exc)]
    problems = [f"a marker not in the one format: {m.group(0)[:60]}" for m in OTHER_MARKER.finditer(text)]
    for block in found:
        where = f"block of line {block.line}"
        problems += [f"{where}: {p}" for p in command_problems(block.command)]
        fields = block.fields
        if "checked" in fields:
            if not (ROOT / fields["checked"]).is_file():
                problems.append(f"{where}: checked by {fields['checked']}, which does not exist")
        else:
            if not DATE.match(fields.get("date", "")):
                problems.append(f"{where}: no date (YYYY-MM-DD HH:MM UTC)")
            if not TREE.match(fields.get("tree", "")):
                problems.append(f"{where}: no tree (a commit)")
    return problems


def prose(text: str) -> str:
    """The text outside fenced code blocks (links and paths in code are commands, not references)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", prose(page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            slug = f"{slug}-{count}"
        seen.setdefault(slug, 1)
    return set(seen)


def link_problems(page: Path) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{page.name}: link to {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{page.name}: link to {target}: no such heading there")
    return problems


def path_problems(page: Path) -> list[str]:
    """Repository paths and gateway modules the page names (in backticks, outside code blocks)."""
    text = prose(page.read_text())
    problems = []
    for path in REPO_PATH.findall(text):
        if any(c in path for c in "*<>") or path.endswith("..."):
            continue
        if not (ROOT / path.rstrip(".")).exists():
            problems.append(f"{page.name}: names {path}, which does not exist")
    for dotted in DOTTED.findall(text):
        parts = dotted.split(".")
        known = [i for i in range(2, len(parts) + 1) if module_file(".".join(parts[:i])) is not None]
        known += [i for i in range(2, len(parts) + 1) if ROOT.joinpath(*parts[:i]).is_dir()]
        if not known:
            problems.append(f"{page.name}: names {dotted}, and no gateway module of that name exists")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_generated_block_names_a_command_that_exists(page: Path) -> None:
    assert block_problems(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_resolves(page: Path) -> None:
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_repository_path_named_exists(page: Path) -> None:
    assert path_problems(page) == []


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make demo" in text
    assert "make test" in text
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name not in BENCHMARK_PAGES:
            assert f"](docs/{page.name}" in text, f"the README's map does not link docs/{page.name}"


def test_every_benchmark_page_is_linked_from_the_benchmarks_page() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for page in BENCHMARK_PAGES:
        assert f"]({page}" in text


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (f"{START} | {D} -->\nx\n{END}\n", "no command"),
        (f"{START} | command: make no-such-target | {D} -->\n{END}\n", "no Makefile target"),
        (f"{START} | command: make loadtest-scale NOPE=1 | {D} -->\n{END}", "reads no variable NOPE"),
        (f"{START} | command: python -m loadtest.gone --x | {D} -->\n{END}", "no module loadtest.gone"),
        (f"{START} | command: python -m loadtest.scale --idz 3 | {D} -->\n{END}", "takes no --idz"),
        (f"{START} | command: make test | tree: 84c4c71 -->\nx\n{END}\n", "no date"),
        (f"{START} | command: make test -->\nx\n{END}\n", "no date"),
        (f"{START} | command: make test | date: not recorded | tree: 84c4c71 -->\n{END}\n", "no date"),
        (f"{START} | command: make test | date: 2026-12-02 03:00 UTC | tree: none -->\n{END}\n", "no tree"),
        (f"{START} | command: make test | checked: tests/test_gone.py -->\nx\n{END}\n", "does not exist"),
        (f"{START} | command: make test | checked: tests/project/test_docs.py -->\nx\n", "without"),
        (f"x\n{END}\n", "without a start"),
        ("<!-- chaos:start -->\nx\n<!-- chaos:end -->\n", "not in the one format"),
    ],
)  # fmt: skip
def test_the_check_refuses_a_block_without_a_real_command(text: str, problem: str) -> None:
    problems = block_problems(text)
    assert any(problem in p for p in problems), problems


def test_a_generators_block_passes_the_check() -> None:
    block = measured("| a | b |", command=".venv/bin/python -m loadtest.scale --ids 20000 --kvgates 1 10")
    assert block_problems(block) == []


def test_the_path_and_link_checks_catch_what_moved(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See [gone](nowhere.md), [the heading](#no-such-heading), `gateway/routing.py`,"
        " `gateway.proxy.cache_salt` and `gateway.core.wire.cache_salt`.\n\n# A heading\n"
    )
    assert link_problems(page) == [
        "page.md: link to nowhere.md: no such file",
        "page.md: link to #no-such-heading: no such heading there",
    ]
    assert path_problems(page) == [
        "page.md: names gateway/routing.py, which does not exist",
        "page.md: names gateway.proxy.cache_salt, and no gateway module of that name exists",
    ]


def test_a_generator_replaces_its_own_block_and_keeps_the_prose(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    old = f"{START} | command: make loadtest-scale | date: not recorded | tree: not recorded -->\nold\n{END}"
    doc.write_text(f"# Title\n\nprose before\n\n{old}\n\nprose after\n")
    write_block(doc, measured("new", command=".venv/bin/python -m loadtest.scale --ids 3"))
    write_block(doc, measured("spread", command=".venv/bin/python -m loadtest.spread --rounds 1"))
    text = doc.read_text()
    assert [b.command for b in blocks(text)] == [
        ".venv/bin/python -m loadtest.scale --ids 3",
        ".venv/bin/python -m loadtest.spread --rounds 1",
    ]
    assert "old" not in text
    assert text.index("prose before") < text.index("new") < text.index("prose after") < text.index("spread")


FIGURES = {  # a page's figures and the committed generator that writes them (issue 26, item 9)
    "README.md": "loadtest.demo_block",
    "docs/workers.md": "loadtest.workers_cost",
    "docs/perf.md": "loadtest.stage_times",
    "docs/chaos.md": "loadtest.chaos",
    "docs/invalidation.md": "loadtest.invalidation",
}


@pytest.mark.parametrize(("page", "module"), FIGURES.items())
def test_every_figure_has_its_command_and_the_tree_it_ran_at(page: str, module: str) -> None:
    found = [b for b in blocks((ROOT / page).read_text()) if module_of(b.command) == module]
    assert found, f"{page} has no block written by {module}"
    for block in found:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", block.fields.get("date", "")), block.fields
        assert re.fullmatch(r"[0-9a-f]{7,40}", block.fields.get("tree", "")), block.fields
