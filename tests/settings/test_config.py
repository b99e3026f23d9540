"""Settings: precedence (command line over KVGATE_* environment over the TOML file over defaults), one flag
per setting generated from the model (docs/configuration.md too: tests/settings/test_config_reference.py), and
refused combinations."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import SecretStr, ValidationError

from gateway.cli.main import build_parser, main, settings_from
from gateway.core.errors import BadRequest
from gateway.fleet.backends import DIALECTS
from gateway.fleet.invalidation import PURGE_ALL, VERSION_SCOPED
from gateway.settings.flags import (
    COMMANDS,
    NOT_SETTINGS,
    description,
    env_var,
    flag,
    flag_overrides,
    setting_names,
    unknown_environment,
)
from gateway.settings.model import Settings, load_settings


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


# A non-default value for every setting, as typed on the command line and as parsed; a new setting needs one.
FLAG_VALUES: dict[str, tuple[str, object]] = {
    "host": ("0.0.0.0", "0.0.0.0"),
    "port": ("9100", 9100),
    "workers": ("3", 3),
    "replicas": ("http://r1:8000/", ["http://r0:8000", "http://r1:8000"]),  # after --replica http://r0:8000
    "store": ("s3://bucket/adapters", "s3://bucket/adapters"),
    "replica_agents": ("http://r0:8000=http://a0:8100|/mnt/a0", ["http://r0:8000=http://a0:8100|/mnt/a0"]),
    "agent_root": ("/mnt/adapters", "/mnt/adapters"),
    "agent_dir": ("/var/adapters", Path("/var/adapters")),
    "agent_host": ("0.0.0.0", "0.0.0.0"),
    "agent_token": ("agent-s3cret", "agent-s3cret"),
    "agent_port": ("8101", 8101),
    "agent_replica": ("http://127.0.0.1:8001", "http://127.0.0.1:8001"),
    "agent_disk_bytes": ("1000000", 1000000),
    "data_dir": ("/srv/kvgate", Path("/srv/kvgate")),
    "redis_url": ("redis://cache:6379/0", "redis://cache:6379/0"),
    "redis_ack_timeout": ("0.25", 0.25),
    "backend": ("sglang", "sglang"),
    "invalidation": ("purge-all", "purge-all"),
    "base_model": ("llama", "llama"),
    "base_model_root": ("/models/llama", "/models/llama"),
    "base_model_dirs": ("llama=/models/llama", ["llama=/models/llama"]),
    "base_print_tolerance": ("0.2", 0.2),
    "reconcile_interval": ("2.5", 2.5),
    "poll_interval": ("0.5", 0.5),
    "background_failure_limit": ("3", 3.0),
    "change_log_length": ("500", 500),
    "scrub_page": ("250", 250),
    "table_max_staleness": ("30", 30.0),
    "snapshot_file_interval": ("2.5", 2.5),
    "drain_grace": ("5", 5.0),
    "max_drain": ("50", 50.0),
    "shutdown_timeout": ("12", 12.0),
    "lease_ttl": ("4", 4.0),
    "gateway_id": ("gw-east-1", "gw-east-1"),
    "max_adapters_per_replica": ("3", 3),
    "slot_wait_timeout": ("4.5", 4.5),
    "max_body_bytes": ("2048", 2048),
    "connect_timeout": ("1.5", 1.5),
    "read_timeout": ("60", 60.0),
    "max_connections_per_replica": ("0", 0),
    "pool_wait_timeout": ("2.5", 2.5),
    "header_timeout": ("3", 3.0),
    "body_timeout": ("20", 20.0),
    "keepalive_timeout": ("15", 15.0),
    "max_connections_per_client": ("64", 64),
    "load_timeout": ("30", 30.0),
    "lock_ttl": ("45", 45.0),
    "prefix_index_entries": ("10", 10),
    "kv_events": ("", False),  # on by default: --no-kv-events
    "kv_event_endpoints": ("http://r0:8000=tcp://h:5557", ["http://r0:8000=tcp://h:5557"]),
    "precise_index_entries": ("10", 10),
    "tokenizer": ("/models/llama/tokenizer.json", Path("/models/llama/tokenizer.json")),
    "token_check_window": ("20", 20),
    "token_check_max_mismatch": ("0.5", 0.5),
    "canary_interval": ("7", 7.0),
    "rollout_gate_interval": ("3", 3.0),
    "rollout_error_margin": ("0.1", 0.1),
    "rollout_min_requests": ("20", 20),
    "rollout_audit_tolerance": ("0.02", 0.02),
    "redis_timeout": ("2.5", 2.5),
    "max_adapter_bytes": ("4096", 4096),
    "admin_token": ("s3cret", "s3cret"),
    "auth": ("api-keys", "api-keys"),
    "auth_max_staleness": ("30", 30.0),
    "admin_host": ("10.0.0.1", "10.0.0.1"),
    "admin_port": ("9101", 9101),
    "expose_replica_urls": ("", True),  # a switch: the flag alone
    "metrics_top_k": ("7", 7),
    "metrics_rerank_interval": ("60", 60.0),
}


@pytest.fixture(autouse=True)
def _no_kvgate_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVGATE_"):
            monkeypatch.delenv(name)


def test_lock_ttl_must_outlive_load_timeout() -> None:
    with pytest.raises(ValidationError, match="lock_ttl"):
        Settings(load_timeout=120, lock_ttl=120)
    with pytest.raises(ValidationError, match=r"lock_ttl \(100 s\) must exceed load_timeout \(120 s\)"):
        Settings(lock_ttl=100)
    defaults = Settings()
    assert defaults.lock_ttl > defaults.load_timeout
    assert Settings(load_timeout=300, lock_ttl=330).lock_ttl == 330


def test_max_drain_is_at_least_the_drain_grace() -> None:
    with pytest.raises(ValidationError, match=r"max_drain \(10 s\) must be at least drain_grace \(30 s\)"):
        Settings(max_drain=10)
    assert Settings(drain_grace=5, max_drain=5).max_drain == 5


def test_api_keys_must_outlive_a_reconcile_and_the_admin_listener_is_a_second_one() -> None:
    with pytest.raises(ValidationError, match=r"auth_max_staleness \(1 s\) must exceed reconcile_interval"):
        Settings(auth="api-keys", auth_max_staleness=1, reconcile_interval=1)
    assert Settings(auth_max_staleness=1, reconcile_interval=1).auth == "off"  # only checked with keys on
    with pytest.raises(ValidationError, match="admin_port"):
        Settings(port=8080, admin_port=8080)
    assert Settings(port=0, admin_port=0).admin_port == 0  # two free ports


def test_kv_events_are_on_by_default_with_no_tokenizer_and_endpoints_are_url_equals_endpoint() -> None:
    """Precise routing needs no flag: events followed where published, each base's tokenizer found."""
    assert Settings().kv_events
    assert Settings().tokenizer is None
    assert Settings(kv_events=True, tokenizer=Path("/m")).kv_events
    assert not Settings(kv_events=False).kv_events
    with pytest.raises(ValidationError, match="REPLICA_URL=tcp://HOST:PORT"):
        Settings(kv_event_endpoints=["http://r0:8000"])


def test_every_setting_is_a_serve_flag_that_sets_it() -> None:
    assert set(FLAG_VALUES) == set(Settings.model_fields)
    argv = ["serve", "--replica", "http://r0:8000"]
    for name, (typed, _) in FLAG_VALUES.items():
        off = flag(name).replace("--", "--no-", 1)  # a boolean that is on by default is turned off
        argv += [flag(name), typed] if typed else [flag(name) if FLAG_VALUES[name][1] else off]
    settings = settings_from(build_parser().parse_args(argv))
    for name, (_, expected) in FLAG_VALUES.items():
        got = getattr(settings, name)
        got = got.get_secret_value() if isinstance(got, SecretStr) else got
        assert got == expected, name
        assert got != Settings.model_fields[name].get_default(call_default_factory=True), name


def test_drain_grace_flag_beats_environment_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text("drain_grace = 9.0\nmax_body_bytes = 4096\nlock_ttl = 200.0\n")
    monkeypatch.setenv("KVGATE_DRAIN_GRACE", "7")
    monkeypatch.setenv("KVGATE_CONFIG", str(config))
    args = build_parser().parse_args(["serve", "--replica", "http://x", "--drain-grace", "5"])
    settings = settings_from(args)
    assert (settings.drain_grace, settings.max_body_bytes, settings.lock_ttl) == (5.0, 4096, 200.0)
    assert settings_from(build_parser().parse_args(["serve"])).drain_grace == 7.0


@pytest.mark.parametrize("command", COMMANDS)
def test_settings_from_passes_exactly_the_flags_the_command_has(command: str) -> None:
    positionals = {"publish": ["t", "dir"], "rollback": ["t"], "bump": ["t"], "versions": ["t"],
                   "history": ["t"], "demo": ["--vllm-python", "py", "--fixture-dir", "fx"],
                   "keys": ["list"], "rollout": ["t", "--percent", "5"], "promote": ["t"],
                   "abort": ["t"]}  # fmt: skip
    args = build_parser().parse_args([command, *positionals.get(command, [])])
    parsed = set(vars(args)) & set(Settings.model_fields)
    assert parsed == set(setting_names(command)) == set(flag_overrides(args, command))
    common = {"store", "data_dir", "redis_url", "base_model", "base_model_root", "backend"}
    assert common <= parsed
    if command == "audit":
        assert {"connect_timeout", "read_timeout", "admin_token"} <= parsed


def test_commands_refuse_settings_they_do_not_use(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["publish", "t", "dir", "--lock-ttl", "5"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --lock-ttl" in capsys.readouterr().err


def test_flag_choices_match_the_backends_and_strategies() -> None:
    assert get_args(Settings.model_fields["backend"].annotation) == DIALECTS
    assert get_args(Settings.model_fields["invalidation"].annotation) == (VERSION_SCOPED, PURGE_ALL)


def test_every_setting_has_a_description_and_an_environment_name() -> None:
    for name in Settings.model_fields:
        assert description(name), name
        assert env_var(name) == f"KVGATE_{name.upper()}"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--load-timeout", "10", "--lock-ttl", "5"], "lock_ttl (5 s) must exceed load_timeout (10 s)"),
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
    ],
)
def test_invalid_settings_exit_2_with_one_line(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--replica", "http://x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate serve: invalid settings: ")
    assert reason in err
    assert len(err.strip().splitlines()) == 1


def _config_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """A named config file kvgate cannot read as settings, and what the error must say of it."""
    directory = tmp_path / "a-directory.toml"
    directory.mkdir()
    not_utf8 = tmp_path / "utf16.toml"
    not_utf8.write_text('auth = "api-keys"\n', encoding="utf-16")
    not_toml = tmp_path / "broken.toml"
    not_toml.write_text('auth = "api-keys\n')
    return {
        "missing": (tmp_path / "no-such.toml", "does not exist"),
        "directory": (directory, "is a directory, not a file"),
        "not-utf8": (not_utf8, "is not UTF-8 text"),
        "not-toml": (not_toml, "is not valid TOML"),
    }


@pytest.mark.parametrize("case", ["missing", "directory", "not-utf8", "not-toml"])
def test_a_named_config_file_that_cannot_be_read_is_an_error(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fail closed: a file meant to turn on ``auth = "api-keys"`` that is not read must never mean the
    defaults (which answer unauthenticated requests). Every command that reads settings refuses it."""
    path, why = _config_cases(tmp_path)[case]
    with pytest.raises(BadRequest, match=f"config file {re.escape(str(path))}: {why}"):
        load_settings({}, path)
    assert main(["serve", "--replica", "http://r:8000", "--config", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"kvgate serve: config file {path}: {why}")
    monkeypatch.setenv("KVGATE_CONFIG", str(path))  # the environment's name for it: the same answer
    positionals = {"publish": ["t", "dir"], "rollback": ["t"], "bump": ["t"], "versions": ["t"],
                   "history": ["t"], "demo": ["--vllm-python", "py", "--fixture-dir", "fx"],
                   "keys": ["list"], "rollout": ["t", "--percent", "5"], "promote": ["t"],
                   "abort": ["t"]}  # fmt: skip
    for command in COMMANDS:
        with pytest.raises(BadRequest, match=why):
            settings_from(build_parser().parse_args([command, *positionals.get(command, [])]))


def test_a_config_value_of_the_wrong_toml_type_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "kvgate.toml"
    config.write_text('auth = "api-keys"\n[replicas]\nurl = "http://r:8000"\n')
    with pytest.raises(ValidationError, match="replicas"):
        load_settings({}, config)
    config.write_text('auth = true\nreplicas = ["http://r:8000"]\n')
    with pytest.raises(ValidationError, match="auth"):
        load_settings({}, config)
    config.write_text('auth = "api-keys"\n')
    assert load_settings({}, config).auth == "api-keys"


def test_a_kvgate_variable_that_names_no_setting_is_refused_with_the_nearest_name() -> None:
    """A typo (``KVGATE_AUHT``) would leave its setting at the default: every command refuses it, naming
    the nearest setting; the documented non-settings and Kubernetes' service links pass."""
    every_setting = {f"KVGATE_{name.upper()}": "x" for name in Settings.model_fields}
    links = {"KVGATE_SERVICE_HOST": "10.0.0.1", "KVGATE_SERVICE_PORT_HTTP": "80",
             "KVGATE_PORT_80_TCP_ADDR": "10.0.0.1", "KVGATE_ADMIN_PORT_9090_TCP": "tcp://a"}  # fmt: skip
    environ = {**every_setting, **dict.fromkeys(NOT_SETTINGS, "x"), **links, "PATH": "/bin",
               "KVGATE_AUHT": "api-keys", "KVGATE_CONFG": "kvgate.toml"}  # fmt: skip
    assert unknown_environment(environ) == [
        "environment variable KVGATE_AUHT is not a kvgate setting (did you mean KVGATE_AUTH?): unset it or "
        "fix its name (see docs/configuration.md)",
        "environment variable KVGATE_CONFG is not a kvgate setting (did you mean KVGATE_CONFIG?): unset it "
        "or fix its name (see docs/configuration.md)",
    ]


def test_replica_agents_name_each_agent_or_one_port_on_every_replica_host() -> None:
    settings = Settings(
        replicas=["http://vllm-0.vllm-headless:8000", "http://10.0.0.5:8000"],
        replica_agents=["*=:8100", "http://10.0.0.5:8000=http://10.0.0.9:9000|/mnt/a"],
    )
    assert settings.agent_map == {
        "http://vllm-0.vllm-headless:8000": ("http://vllm-0.vllm-headless:8100", "/adapters"),
        "http://10.0.0.5:8000": ("http://10.0.0.9:9000", "/mnt/a"),
    }
    with pytest.raises(ValidationError, match=r"REPLICA_URL=AGENT_URL\[\|ROOT\]"):
        Settings(replica_agents=["http://10.0.0.5:8000"])
