"""The settings as command-line flags and as a markdown table, both generated from ``Settings``.

The table heads docs/configuration.md
(``python -m gateway.settings.reference --write docs/configuration.md``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import SecretStr

from gateway.settings.model import Settings

COMMANDS = (
    "serve",
    "publish",
    "rollback",
    "bump",
    "status",
    "audit",
    "demo",
    "keys",
    "versions",
    "history",
    "gc",
    "agent",
    "rollout",
    "promote",
    "abort",
)

# Where the table and the store are, and which base and backend they belong to: every command reads them.
_EVERY_COMMAND = frozenset(
    {"store", "data_dir", "redis_url", "redis_timeout", "base_model", "base_model_root", "backend"}
)
_ACKED = frozenset({"redis_ack_timeout"})  # the commands that change the table wait for a replica's ack
# publish and rollout store a version and fingerprint its base: they ask the replicas which base they serve,
# read its bytes and take its behaviour (cli/base_model.py)
_FINGERPRINTS = _ACKED | {
    "max_adapter_bytes", "replicas", "connect_timeout", "read_timeout", "base_print_tolerance",
    "base_model_dirs",
}  # fmt: skip
_ALSO: dict[str, frozenset[str]] = {
    # audit talks to servers, waits for kvgate to serve what it published, and pins through the gateway
    "audit": _ACKED
    | {"connect_timeout", "read_timeout", "reconcile_interval", "admin_token", "max_adapter_bytes"},
    "publish": _FINGERPRINTS,
    "rollback": _ACKED,
    "rollout": _FINGERPRINTS,
    "promote": _ACKED,
    "abort": _ACKED,
    "bump": _ACKED,
    "gc": frozenset({"replicas", "connect_timeout", "read_timeout"}),  # it asks the replicas what they list
    "agent": frozenset(
        {
            "agent_dir",
            "agent_host",
            "agent_port",
            "agent_replica",
            "agent_root",
            "agent_token",
            "agent_disk_bytes",
        }
    ),
}
_FLAGS = {"replicas": "--replica"}  # the one flag not named after its field (it is given once per URL)
_METAVARS = {"replicas": "URL"}


def setting_names(command: str) -> tuple[str, ...]:
    """The settings ``command`` takes as flags, in the model's order: what ``settings_from`` passes on."""
    if command not in COMMANDS:
        raise KeyError(f"unknown command {command!r}")
    wanted = _EVERY_COMMAND | _ALSO.get(command, frozenset())
    return tuple(name for name in Settings.model_fields if command == "serve" or name in wanted)


def flag(name: str) -> str:
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def env_var(name: str) -> str:
    return f"{Settings.model_config.get('env_prefix', '')}{name}".upper()


NOT_SETTINGS = {
    "KVGATE_CONFIG": "the TOML config file (--config)",
    "KVGATE_VLLM_PYTHON": "tests and make: the vLLM CPU virtualenv's python",
    "KVGATE_FIXTURE_DIR": "tests and make: the tiny model and adapters",
    "KVGATE_OTHER_BASE_DIR": "tests and make: a second base model",
    "KVGATE_SCREENSHOT": "tests: where the status page's screenshot is written",
    "KVGATE_ROLLOUT_SCREENSHOT": "tests: where the rollout view's screenshot is written",
}
"""The ``KVGATE_*`` variables that are not settings, and what reads them (docs/configuration.md)."""
SERVICE_LINK = re.compile(r"KVGATE(_\w+)?_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_\w+)?)")
"""What Kubernetes sets for a Service named ``kvgate`` or ``kvgate-*`` (``KVGATE_SERVICE_HOST``,
``KVGATE_PORT_80_TCP_ADDR``...) in every pod of its namespace: never a typo of a setting."""


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """A line per ``KVGATE_*`` variable that names no setting, with the nearest name: every command
    refuses to start on one (a typo such as ``KVGATE_AUHT`` would leave its setting at the default,
    here ``auth = "off"``). ``NOT_SETTINGS`` and Kubernetes' service links are not settings and pass."""
    known = [env_var(name) for name in Settings.model_fields] + list(NOT_SETTINGS)
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("KVGATE_") or upper in known or SERVICE_LINK.fullmatch(upper):
            continue
        nearest = difflib.get_close_matches(upper, known, n=1)
        hint = f" (did you mean {nearest[0]}?)" if nearest else ""
        problems.append(
            f"environment variable {name} is not a kvgate setting{hint}: unset it or fix its name "
            "(see docs/configuration.md)"
        )
    return problems


DEFAULT_REASON = "\n\nDefault: "
"""Where a setting's docstring says why its default is what it is (its last paragraph)."""


def _docstring(name: str) -> tuple[str, str]:
    text = Settings.model_fields[name].description
    if not text:
        raise TypeError(f"setting {name} has no docstring: it is its --help and its reference entry")
    what, found, why = text.partition(DEFAULT_REASON)
    if not found:
        raise TypeError(
            f"setting {name}'s docstring does not end with why its default is chosen ('Default: ...')"
        )
    return " ".join(what.replace("``", "`").split()), " ".join(why.replace("``", "`").split())


def description(name: str) -> str:
    """What the setting does (its docstring, without why the default)."""
    return _docstring(name)[0]


def default_reason(name: str) -> str:
    """Why the setting's default is what it is (its docstring's last paragraph, ``Default: ...``)."""
    return _docstring(name)[1]


def default(name: str) -> str:
    value = Settings.model_fields[name].get_default(call_default_factory=True)
    return "unset" if value is None or value == [] else f"`{value}`"


def _argument_kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's type (``X | None`` is ``X``: an absent flag means not given)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        if not all(isinstance(choice, str) for choice in choices):
            raise TypeError(f"no flag for {annotation}: choices must be strings")
        return {"choices": choices}
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return {"action": "append", **_argument_kind(item)}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation is SecretStr:
        return {"type": str}
    if annotation in (str, int, float, Path):
        return {"type": annotation}
    raise TypeError(f"no flag for a setting of type {annotation}")


def add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group(
        "settings", "a flag beats KVGATE_<NAME>, which beats the --config file, which beats the default"
    )
    for name in setting_names(command):
        kind = _argument_kind(Settings.model_fields[name].annotation)
        shown = f"{description(name)} [{env_var(name)}; default {default(name).strip('`')}]"
        if name in _METAVARS:
            kind["metavar"] = _METAVARS[name]
        group.add_argument(flag(name), dest=name, default=None, help=shown.replace("%", "%%"), **kind)


def flag_overrides(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The settings given on the command line (``None``: not given), for ``load_settings``."""
    return {name: getattr(args, name) for name in setting_names(command)}


def _commands(name: str) -> str:
    using = [command for command in COMMANDS if name in setting_names(command)]
    return "all" if len(using) == len(COMMANDS) else ", ".join(using)


def markdown() -> str:
    """The settings table: one row per ``Settings`` field."""
    lines = [
        "| setting | flag | environment | default | commands | description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in Settings.model_fields:
        cells = (f"`{name}`", f"`{flag(name)}`", f"`{env_var(name)}`", default(name), _commands(name),
                 description(name).replace("|", "\\|"))  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tenant_warnings(settings: Settings, cache_namespaces: bool) -> list[str]:
    """What an operator running API keys (tenants) should know about this setup."""
    if settings.auth == "off":
        return []
    warnings = []
    if not cache_namespaces:
        warnings.append(
            f"{settings.backend} replicas have no cache namespace: base-model callers of every tenant share "
            "one prefix cache (the timing side channel between tenants stays open)"
        )
    if settings.admin_port is None:
        warnings.append(
            "API keys on, but the admin surface (/metrics names logical IDs) is on the public "
            "listener, behind the admin token: set admin_port to serve it on a listener of its own"
        )
    return warnings
