"""``docs/configuration.md``, generated from ``Settings`` (gateway/settings/model.py): every setting with its
flag, environment variable, TOML key, type and bounds, default and why it is chosen, the commands that
take it and its description, then the rules between settings (the model's validators, by their docstrings).

    python -m gateway.settings.reference --write docs/configuration.md   # --check: exit 1 if it drifted
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import SecretStr

from gateway.dev import generated_docs
from gateway.settings.flags import (
    COMMANDS,
    NOT_SETTINGS,
    default,
    default_reason,
    description,
    env_var,
    flag,
    markdown,
    setting_names,
)
from gateway.settings.model import Settings

TITLE = "# Configuration reference\n"
COMMAND = "python -m gateway.settings.reference --write docs/configuration.md"
TEST = "tests/settings/test_config_reference.py"
HEADER = """\
Generated from `Settings` in gateway/settings/model.py by `python -m gateway.settings.reference --write
docs/configuration.md`; tests/settings/test_config_reference.py fails when this file drifts. Do not edit by
hand.

Every setting is a command-line flag, a `KVGATE_<NAME>` environment variable and a key in a TOML file named
by `--config` (or `KVGATE_CONFIG`). A flag beats the environment, which beats the file, which beats the
default. `kvgate serve` takes every setting; the other commands take the ones they use (**commands**
below). A list (`replicas`) is `--replica URL` once per item, comma-separated in the environment
(`KVGATE_REPLICAS=http://a:8000,http://b:8000`) and a TOML array. A value kvgate refuses (wrong type, out
of bounds, or against a rule below) is one line on stderr and exit 2, before anything starts; so is a
named config file that does not exist, is a directory, cannot be read, is not UTF-8 or is not TOML (never
the defaults in its place).

```toml
# kvgate.toml: kvgate serve --config kvgate.toml
replicas = ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
store = "/shared/adapters"
redis_url = "redis+sentinel://10.0.0.11:26379,10.0.0.12:26379,10.0.0.13:26379/kvgate"
admin_port = 9090
```

Secrets: prefer `KVGATE_ADMIN_TOKEN` (or the file, readable only by kvgate) to `--admin-token`, which
other users of the machine can read in the process list.
"""


def type_text(annotation: Any) -> str:
    """A field's type in words (``X | None`` is X: unset is the default's business)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {type_text(get_args(annotation)[0])}"
    names = {str: "string", int: "integer", float: "number", bool: "boolean",
             Path: "path", SecretStr: "secret string (never printed)"}  # fmt: skip
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


_BOUNDS = ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "≤"),
           (annotated_types.Lt, "lt", "<"))  # fmt: skip


def bounds(name: str) -> str:
    """The field's numeric bounds (``Field(ge=..., ...)``), e.g. ``≥ 0, ≤ 65535``."""
    return ", ".join(
        f"{sign} {getattr(rule, attribute)}"
        for rule in Settings.model_fields[name].metadata
        for kind, attribute, sign in _BOUNDS
        if isinstance(rule, kind)
    )


def toml_example(name: str) -> str:
    value = Settings.model_fields[name].get_default(call_default_factory=True)
    if value is None or value == []:
        sample = {"replicas": ["http://10.0.0.5:8000"]}.get(name, "...")
        return f"{name} = {json.dumps(sample)}" if sample != "..." else f"# {name} = ... (unset by default)"
    if isinstance(value, bool):
        return f"{name} = {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"{name} = {value}"
    return f"{name} = {json.dumps(str(value))}"


def _commands(name: str) -> str:
    using = [command for command in COMMANDS if name in setting_names(command)]
    return "every command" if len(using) == len(COMMANDS) else ", ".join(f"`{c}`" for c in using)


def section(name: str) -> str:
    field = Settings.model_fields[name]
    kind = type_text(field.annotation)
    limits = bounds(name)
    rows = [
        ("flag", f"`{flag(name)}`" + (" (repeat it)" if get_origin(field.annotation) is list else "")),
        ("environment", f"`{env_var(name)}`"),
        ("TOML", f"`{toml_example(name)}`"),
        ("type", kind + (f" ({limits})" if limits else "")),
        ("default", default(name)),
        ("commands", _commands(name)),
    ]
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    why = f"**Why this default:** {default_reason(name)}"
    return f"### `{name}`\n\n{description(name)}\n\n{why}\n\n| | |\n| --- | --- |\n{table}\n"


def rules() -> str:
    found = []
    for decorator in Settings.__pydantic_decorators__.model_validators.values():
        doc = decorator.func.__doc__
        if not doc:
            raise TypeError(f"validator {decorator.cls_var_name} has no docstring: it is its rule's text")
        found.append("- " + " ".join(doc.split()))
    return "## Rules between settings\n\n" + "\n".join(found) + "\n"


def at_a_glance() -> str:
    """The settings table (flags.markdown), each name linked to its section."""
    table = markdown()
    for name in Settings.model_fields:
        table = table.replace(f"| `{name}` |", f"| [`{name}`](#{name}) |", 1)
    return table


def not_settings() -> str:
    """The ``KVGATE_*`` variables that are no setting (flags.NOT_SETTINGS); any other refuses."""
    listed = "\n".join(f"| `{name}` | {what} |" for name, what in NOT_SETTINGS.items())
    return (
        "## Variables that are not settings\n\n"
        "Every command refuses to start (exit 2, one line naming the variable and the nearest setting)\n"
        "on a `KVGATE_*` environment variable that names no setting, as on a TOML key that names none:\n"
        "a typo (`KVGATE_AUHT=api-keys`) must not leave its setting at the default. These are read\n"
        "elsewhere and pass, as do the variables Kubernetes sets for a Service named `kvgate` or\n"
        "`kvgate-*` (`KVGATE_SERVICE_HOST`, `KVGATE_SERVICE_PORT_HTTP`, `KVGATE_PORT_80_TCP_ADDR`...).\n"
        "Kubernetes sets `KVGATE_PORT=tcp://...` too: set `KVGATE_PORT` (and `KVGATE_ADMIN_PORT`) in\n"
        "the container, as deploy/ does, and the container's value wins.\n\n"
        f"| variable | read by |\n| --- | --- |\n{listed}\n"
    )


def document() -> str:
    sections = [section(name) for name in Settings.model_fields]
    parts = [HEADER, f"## Settings\n\n{at_a_glance()}", *sections, rules(), not_settings()]
    return TITLE + "\n" + generated_docs.checked("\n".join(parts), command=COMMAND, test=TEST) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.settings.reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="FILE", help="write the reference to FILE")
    action.add_argument("--check", type=Path, metavar="FILE", help="exit 1 if FILE is not the reference")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(document())
    elif args.check:
        if not args.check.is_file() or args.check.read_text() != document():
            print(f"{args.check}: stale; run {parser.prog} --write {args.check}", file=sys.stderr)
            return 1
    else:
        print(document(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
