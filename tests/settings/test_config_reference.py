"""docs/configuration.md is generated from ``Settings``: the committed file must be the generated one."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings.flags import env_var, flag
from gateway.settings.model import Settings
from gateway.settings.reference import document, main

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_the_generated_one() -> None:
    assert REFERENCE.read_text() == document(), "run: python -m gateway.settings.reference --write " + str(
        REFERENCE
    )
    assert main(["--check", str(REFERENCE)]) == 0


def test_every_setting_has_its_section_flag_variable_and_bounds() -> None:
    text = document()
    for name in Settings.model_fields:
        assert f"### `{name}`" in text
        assert f"`{flag(name)}`" in text
        assert f"`{env_var(name)}`" in text
    assert "| type | integer (≥ 0, ≤ 65535) |" in text.split("### `port`")[1].split("###")[0]
    assert "`lock_ttl` exceeds `load_timeout`" in text


def test_check_fails_on_a_stale_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(document().replace("Address the gateway listens on.", "Old words."))
    assert main(["--check", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
