"""The wheel carries the Lua scripts: an installed kvgate finds them without a source tree."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_every_lua_script(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("kvgate-*.whl")
    shipped = {
        Path(name).name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("gateway/lua/")
    }
    assert shipped == {path.name for path in (ROOT / "lua").glob("*.lua")}
