"""The wheel carries the Lua scripts and their lib: an installed kvgate finds them without a source tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (built,) = out.glob("kvgate-*.whl")
    return built


def test_wheel_ships_every_lua_script(wheel: Path) -> None:
    shipped = {
        name.removeprefix("gateway/lua/")
        for name in zipfile.ZipFile(wheel).namelist()
        if name.startswith("gateway/lua/")
    }
    on_disk = {path.relative_to(ROOT / "lua").as_posix() for path in (ROOT / "lua").rglob("*.lua")}
    assert "lib/common.lua" in on_disk, "the lib every script is assembled with"
    assert shipped == on_disk


def test_installed_wheel_assembles_every_script(wheel: Path, tmp_path: Path) -> None:
    """Unpacked away from the source tree, the package reads its lib and assembles each operation."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import json, gateway.table.scripts as e\n"
        "print(json.dumps({'dir': str(e.lua_dir()), 'codes': dict(e.codes()),\n"
        "                  'scripts': {n: e.assemble_script(n) for n in e.operation_names()}}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert str(site) in found["dir"], "read from the unpacked wheel, not the source tree"
    assert found["codes"]["CHANGED"] == 1
    lib = (ROOT / "lua" / "lib" / "common.lua").read_text()
    assert set(found["scripts"]) == {path.stem for path in (ROOT / "lua").glob("*.lua")}
    assert all(lib in text for text in found["scripts"].values())


def test_wheel_ships_every_module_and_the_command(wheel: Path) -> None:
    """setuptools' packages list names every part (one left out installs without its modules), and the
    ``kvgate`` console script names a module the wheel ships."""
    names = zipfile.ZipFile(wheel).namelist()
    on_disk = {path.relative_to(ROOT).as_posix() for path in (ROOT / "gateway").rglob("*.py")}
    assert sorted(on_disk - set(names)) == []
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    (target,) = [line.split("=", 1)[1].strip() for line in scripts.splitlines() if line.startswith("kvgate ")]
    module, _, function = target.partition(":")
    assert module.replace(".", "/") + ".py" in names, target
    assert f"def {function}(" in (ROOT / (module.replace(".", "/") + ".py")).read_text(), target
