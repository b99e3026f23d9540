"""The house keeps its shape: import rules between the parts of ``gateway/`` and small modules.

Parts stand on floors; a module imports only from its own part or from a part on a lower floor, so no
import runs upward. On top of that, the rules the layout names: ``core/`` imports nothing of kvgate but
itself (it is pure); nothing in ``core/``, ``table/`` or ``fleet/`` imports ``request/`` or ``proof/``;
``proof/`` never imports ``request/`` (the proof code does not sit on the path it audits).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GATEWAY = ROOT / "gateway"
MAX_LINES = 350
FLOORS = {
    "core": 0,
    "telemetry": 1,
    "periodic": 1,
    "table": 2,
    "fleet": 3,
    "adapters": 3,
    "request": 4,
    "proof": 4,
    "agent": 4,  # the per-replica sidecar: the object store (adapters) and the replica's answers (fleet)
}
TOP = 5  # app, cli, config, serving, demo, vllm_process: they wire the parts together


def part_of(module: str) -> str:
    """``gateway.fleet.loader`` -> ``fleet``; a top-level module (``gateway.app.wiring``) is its own part."""
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


def test_the_rules_see_every_part() -> None:
    parts = {part_of(name) for name, _ in modules() if name.count(".") > 1}
    assert parts == {"core", "table", "fleet", "adapters", "request", "proof", "telemetry", "agent"}
    assert gateway_imports(GATEWAY / "app.py"), "the parser finds imports (so the checks can fail)"


@pytest.mark.parametrize(("module", "path"), modules(), ids=[name for name, _ in modules()])
def test_no_import_runs_upward(module: str, path: Path) -> None:
    own = part_of(module)
    for imported in gateway_imports(path):
        other = part_of(imported)
        if other == own:
            continue
        below = floor(other) < floor(own) or floor(own) == TOP  # the top-level wiring may use each other
        assert below, f"{module} imports {imported}: {other} is not below {own}"
        if own == "core":
            pytest.fail(f"core is pure: {module} imports {imported}")
        if own in ("core", "table", "fleet") and other in ("request", "proof"):
            pytest.fail(f"{module} imports {imported}")
        if own == "proof" and other == "request":
            pytest.fail(f"the proof code imports the request path: {module} imports {imported}")


@pytest.mark.parametrize(("module", "path"), modules(), ids=[name for name, _ in modules()])
def test_modules_stay_small(module: str, path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"


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
