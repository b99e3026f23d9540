"""Settings precedence: command line over KVGATE_* environment over the TOML config file over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import load_settings


def test_cli_beats_env_beats_file_beats_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text(
        'port = 9001\nbase_model = "from-file"\ndrain_grace = 5.0\nreplicas = ["http://file:8000"]\n'
    )
    monkeypatch.setenv("KVGATE_PORT", "9002")
    monkeypatch.setenv("KVGATE_REPLICAS", "http://a:8000/, http://b:8000")
    settings = load_settings({"port": 9003, "store": None}, config)
    assert settings.port == 9003  # command line
    assert settings.replicas == ["http://a:8000", "http://b:8000"]  # environment, comma-separated
    assert settings.base_model == "from-file"  # config file
    assert settings.drain_grace == 5.0
    assert settings.reconcile_interval == 1.0  # default
    assert load_settings({}, config).port == 9002


def test_unknown_keys_and_bad_values_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        load_settings({}, config)
    with pytest.raises(ValidationError):
        load_settings({"invalidation": "sometimes"}, None)
