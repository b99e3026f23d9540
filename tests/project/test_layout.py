"""The house keeps its shape: every module lives in the part it is about, and no import runs upward.

``gateway/``'s top level holds only entry points: ``__init__.py`` (and a ``__main__.py``, if one is added) and
``healthcheck.py``, the image's probe, whose path the Dockerfile, deploy/ and install.sh name. Every other
module lives in the part it is about; a long module is a reason to look at it, never to move code out of
its part to make room.

Parts stand on floors; a module imports only from its own part or from a part on a lower floor, so no
import runs upward. The wiring on top (settings, process, app, cli, dev) may use each other. On top of
that, the rules the layout names: ``core/`` imports nothing of kvgate but itself (it is pure); ``core/``,
``table/``, ``kv/`` and ``fleet/`` never import ``request/``, ``proof/``, ``process/``, ``app/`` or ``cli/``;
``proof/`` never imports ``request/`` (the proof code does not sit on the path it audits).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
ENTRY_POINTS = {"__init__.py", "__main__.py", "healthcheck.py"}
FLOORS = {
    "core": 0,
    "telemetry": 1,
    "tasks": 1,  # the supervisor and its loops: table/ and fleet/ run under it
    "table": 2,
    "fleet": 3,
    "adapters": 3,
    "kv": 4,  # the KV-event path: it follows the fleet's replicas; the request path tokenizes with it
    "request": 5,
    "proof": 5,
    "agent": 5,  # the per-replica sidecar: the object store (adapters) and the replica's answers (fleet)
}
WIRING = {"settings", "process", "app", "cli", "dev"}  # on top: they wire the parts together
TOP = 6
NEVER_UP = (("core", "table", "kv", "fleet"), ("request", "proof", "process", "app", "cli"))


def part_of(module: str) -> str:
    """``gateway.fleet.loader`` -> ``fleet``; a top-level module (``gateway.healthcheck``) is its own part."""
    return module.split(".")[1]


def floor(part: str) -> int:
    return FLOORS.get(part, TOP)


def gateway_imports(path: Path) -> set[str]:
    """Every ``gateway.*`` module a file imports, at any depth (function-level imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gateway"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if node.module == "gateway")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("gateway"))
    return {name for name in found if name != "gateway"}


def modules() -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(ROOT).with_suffix("").parts), path)
        for path in sorted(GATEWAY.rglob("*.py"))
    ]


def import_problems(module: str, imported: Iterable[str]) -> list[str]:
    """Why ``module`` may not import each of ``imported`` (empty: it may)."""
    own, problems = part_of(module), []
    for name in sorted(imported):
        other = part_of(name)
        if other == own:
            continue
        if own == "core":
            problems.append(f"core is pure: {module} imports {name}")
        elif own in NEVER_UP[0] and other in NEVER_UP[1]:
            problems.append(f"{own} never imports {other}: {module} imports {name}")
        elif own == "proof" and other == "request":
            problems.append(f"the proof code imports the request path: {module} imports {name}")
        elif not (floor(other) < floor(own) or floor(own) == TOP):
            problems.append(f"{module} imports {name}: {other} is not below {own}")
    return problems


def stray_modules(names: Iterable[str]) -> list[str]:
    """The files at gateway/'s top level that are not entry points."""
    return sorted(name for name in names if name.endswith(".py") and name not in ENTRY_POINTS)


def test_the_top_level_holds_only_entry_points() -> None:
    stray = stray_modules(path.name for path in GATEWAY.iterdir())
    assert stray == [], "a module lives in the part it is about (tests/project/test_layout.py's docstring)"


def test_every_part_has_a_floor() -> None:
    parts = {part_of(name) for name, _ in modules() if name.count(".") > 1}
    assert parts == set(FLOORS) | WIRING, "a new part gets its place in FLOORS or WIRING (and its rules)"


def test_the_rules_catch_what_they_forbid() -> None:
    assert gateway_imports(GATEWAY / "app" / "wiring.py"), "the parser finds imports"
    forbidden = {
        "gateway.core.scheduler": "gateway.telemetry.metrics",
        "gateway.table.snapshot": "gateway.cli.main",
        "gateway.fleet.loader": "gateway.process.parent",
        "gateway.kv.index": "gateway.app.keys",
        "gateway.core.body": "gateway.kv.events",  # core is pure: the scheduler reads kv through a Protocol
        "gateway.kv.follower": "gateway.request.status_page",
        "gateway.proof.audit": "gateway.request.proxy",
        "gateway.tasks.supervisor": "gateway.table.keys",
        "gateway.request.proxy": "gateway.settings.model",
    }
    for module, imported in forbidden.items():
        assert import_problems(module, [imported]), f"{module} may not import {imported}"
    assert import_problems("gateway.cli.main", ["gateway.process.parent", "gateway.core.errors"]) == []
    assert import_problems("gateway.request.proxy", ["gateway.kv.prompt_tokens"]) == [], "kv is below request"
    assert stray_modules(["__init__.py", "healthcheck.py", "serving.py", "lua"]) == ["serving.py"]


@pytest.mark.parametrize(("module", "path"), modules(), ids=[name for name, _ in modules()])
def test_no_import_runs_upward(module: str, path: Path) -> None:
    assert import_problems(module, gateway_imports(path)) == []


def test_the_architecture_module_table_matches_the_tree() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `gateway/")]
    named = {path for row in rows for path in row.split("|")[1].strip().replace("`", "").split(", ")}
    assert named, "docs/architecture.md has a module table"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == [], "docs/architecture.md names modules that do not exist"
    unnamed = [
        str(path.relative_to(ROOT))
        for path in GATEWAY.rglob("*.py")
        if path.name != "__init__.py"
        and str(path.relative_to(ROOT)) not in named
        and not any(str(path.relative_to(ROOT)).startswith(p) for p in named if p.endswith("/"))
    ]
    assert sorted(unnamed) == [], "modules missing from docs/architecture.md's module table"


def test_tests_mirror_the_parts() -> None:
    """A test module sits in the folder of the part it tests (or tests/vllm/, the real-server scenarios);
    what tests share sits in tests/support/. Nothing at tests/' top but the package and its conftest."""
    tests = ROOT / "tests"
    assert {p.name for p in tests.glob("*.py")} == {"__init__.py", "conftest.py"}
    parts = {p.name for p in GATEWAY.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    # not parts of gateway/: named for what they hold
    scenario_folders = {"support", "vllm", "deploy", "project"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= parts | scenario_folders, sorted(folders - parts - scenario_folders)
    assert not list((tests / "support").glob("test_*.py")), "support holds no tests"
