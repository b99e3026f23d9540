"""Settings: command-line options over ``KVGATE_*`` environment variables over a TOML config file.

The config file is named by ``--config`` or ``KVGATE_CONFIG``; its keys are the field names below
(``replicas = ["http://10.0.0.5:8000"]``). ``KVGATE_REPLICAS`` takes a comma-separated list.

Each field's docstring is its description, and the model is the one list of settings: each field is a
flag ``--field-name`` (``replicas`` keeps ``--replica URL``, repeated), typed by its annotation, and a
``KVGATE_FIELD_NAME`` variable. ``serve`` takes every setting; the other commands take the ones they use
(``setting_names``). The README's settings table is generated here too; after changing a setting::

    python -m gateway.config --write README.md   # --check README.md: exit 1 if it drifted
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from gateway.core.identity import base_identity


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", extra="forbid", frozen=True, use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Address the gateway listens on."""
    port: int = Field(8080, ge=0, le=65535)
    """Port the gateway listens on (0: any free port)."""
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Base URLs of the replicas kvgate fronts (flag: repeat it; environment: comma-separated)."""
    store: Path = Path(".kvgate/store")
    """Content-addressed adapter store; every replica must see it at the same path."""
    data_dir: Path = Path(".kvgate")
    """Holds the embedded Redis (its data and socket)."""
    redis_url: str | None = None
    """Use this Redis instead of the embedded one: ``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://HOST:PORT,.../MASTER[/DB]`` or ``redis+cluster://HOST:PORT,...`` (README: Redis)."""
    redis_ack_timeout: float = Field(1.0, ge=0, le=4)
    """Seconds publish, rollback and bump wait for one Redis replica to acknowledge their write (``WAIT``),
    when the master has replicas; 0: do not wait; at most 4 (the Redis client's socket timeout is 5)."""

    backend: Literal["vllm", "sglang", "generic"] = "vllm"
    """The replicas' server kind (its dialect: load/unload API and cache namespace field)."""
    invalidation: Literal["version-scoped", "purge-all"] = "version-scoped"
    """version-scoped: versioned names + per-epoch cache salts; purge-all: reset every replica's cache."""
    base_model: str = "base"
    """The served model name of the pool's base model: what clients send for base requests."""
    base_model_root: str | None = None
    """If set, a replica's base must also report this ``root`` in /v1/models to be eligible."""

    reconcile_interval: float = Field(1.0, gt=0)
    """Seconds between full re-reads of the epoch table (change hints arrive sooner)."""
    poll_interval: float = Field(1.0, gt=0)
    """Seconds between polls of every replica's /v1/models (and sweeps of retired adapters)."""
    drain_grace: float = Field(30.0, ge=0)
    """Seconds in-flight requests on a retired version get before it is unloaded (or caches purged)."""
    max_adapters_per_replica: int = Field(8, ge=1)
    """Adapters kvgate keeps loaded per replica; the least recently used idle one is evicted first."""
    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body accepted; a larger one is refused with 413."""
    connect_timeout: float = Field(5.0, gt=0)
    """Seconds to connect to a replica (in ``kvgate audit``: to each audited server)."""
    read_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for each read from a replica (in ``kvgate audit``: from each audited server)."""
    load_timeout: float = Field(120.0, gt=0)
    """Seconds an adapter load may take (also the wait for another kvgate's load of it)."""
    lock_ttl: float = Field(150.0, gt=0)
    """Seconds a load lock lives in Redis; must exceed load_timeout, or a second kvgate could load too."""
    prefix_index_entries: int = Field(100_000, ge=0)
    """Prefix block keys remembered (LRU) for routing warm requests to the replica that holds them."""
    canary_interval: float = Field(0.0, ge=0)
    """Seconds between coherence canary rounds over active logical IDs; 0 turns the canary off."""
    admin_token: SecretStr | None = None
    """Admin token (header ``x-kvgate-admin-token``): pinning, cold namespaces, status. Prefer the env var."""

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [str(url).strip().rstrip("/") for url in value]
        return value

    @model_validator(mode="after")
    def _lock_outlives_load(self) -> Self:
        if self.lock_ttl <= self.load_timeout:
            raise ValueError(
                f"lock_ttl ({self.lock_ttl:g} s) must exceed load_timeout ({self.load_timeout:g} s): "
                "a load lock that expires mid-load lets a second kvgate load the same adapter"
            )
        return self

    @property
    def base_identity(self) -> str:
        """The pool's base model identity, recorded with every published version."""
        return base_identity(self.base_model, self.base_model_root)


def load_settings(overrides: Mapping[str, Any], config_file: Path | None) -> Settings:
    """Build settings with precedence: ``overrides`` (CLI) > environment > config file > defaults."""

    class _WithFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
            if config_file is not None:
                sources += (TomlConfigSettingsSource(settings_cls, toml_file=config_file),)
            return sources

    return _WithFile(**{k: v for k, v in overrides.items() if v is not None})


def describe_invalid(exc: ValidationError) -> str:
    """One line for an operator: each refused setting and why (never the value: it may be a secret)."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        why = " ".join(error["msg"].removeprefix("Value error, ").split())
        problems.append(f"{where}: {why}" if where else why)
    return "invalid settings: " + "; ".join(problems)


# The settings as command-line flags and as the README table, both generated from the model.

START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"
COMMANDS = ("serve", "publish", "rollback", "bump", "status", "audit", "demo")

# Where the table and the store are, and which base and backend they belong to: every command reads them.
_EVERY_COMMAND = frozenset({"store", "data_dir", "redis_url", "base_model", "base_model_root", "backend"})
_ALSO: dict[str, frozenset[str]] = {
    # audit talks to servers, waits for kvgate to serve what it published, and pins through the gateway
    "audit": frozenset(
        {"connect_timeout", "read_timeout", "reconcile_interval", "admin_token", "redis_ack_timeout"}
    ),
    # the commands that change the table wait for a Redis replica's acknowledgement
    "publish": frozenset({"redis_ack_timeout"}),
    "rollback": frozenset({"redis_ack_timeout"}),
    "bump": frozenset({"redis_ack_timeout"}),
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


def description(name: str) -> str:
    text = Settings.model_fields[name].description
    if not text:
        raise TypeError(f"setting {name} has no docstring: it is its --help and its README row")
    return " ".join(text.replace("``", "`").split())


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


def block() -> str:
    """What the README holds between (and including) the markers."""
    return f"{START}\n{markdown()}{END}"


def _span(text: str) -> tuple[int, int]:
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"expected one {START} ... {END} block")
    return text.index(START), text.index(END) + len(END)


def readme_block(text: str) -> str:
    start, end = _span(text)
    return text[start:end]


def with_block(text: str) -> str:
    """``text`` with its settings block regenerated."""
    start, end = _span(text)
    return text[:start] + block() + text[end:]


def readme_table_tool(argv: Sequence[str] | None = None) -> int:
    """``python -m gateway.config [--write | --check] README.md``: print, regenerate or check the table."""
    parser = argparse.ArgumentParser(
        prog="python -m gateway.config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="regenerate the block in this file")
    action.add_argument("--check", type=Path, metavar="README", help="exit 1 if the block there drifted")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(with_block(args.write.read_text()))
    elif args.check:
        if readme_block(args.check.read_text()) != block():
            print(f"{args.check}: settings table is stale; run {parser.prog} --write", file=sys.stderr)
            return 1
    else:
        print(markdown(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(readme_table_tool())
