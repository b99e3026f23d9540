"""Settings: command-line options over ``KVGATE_*`` environment variables over a TOML config file.

The config file is named by ``--config`` or ``KVGATE_CONFIG``; its keys are the field names below
(``replicas = ["http://10.0.0.5:8000"]``). ``KVGATE_REPLICAS`` takes a comma-separated list.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from gateway.core.identity import base_identity


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    store: Path = Path(".kvgate/store")
    data_dir: Path = Path(".kvgate")
    redis_url: str | None = None

    backend: Literal["vllm", "sglang", "generic"] = "vllm"
    """The replicas' server kind (its dialect: load/unload API and cache namespace field)."""
    invalidation: Literal["version-scoped", "purge-all"] = "version-scoped"
    """version-scoped: versioned names + per-epoch cache salts; purge-all: reset every replica's cache."""
    base_model: str = "base"
    """The served model name of the pool's base model: what clients send for base requests."""
    base_model_root: str | None = None
    """If set, a replica's base must also report this ``root`` in /v1/models to be eligible."""

    reconcile_interval: float = Field(1.0, gt=0)
    poll_interval: float = Field(1.0, gt=0)
    drain_grace: float = Field(30.0, ge=0)
    max_adapters_per_replica: int = Field(8, ge=1)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(600.0, gt=0)
    load_timeout: float = Field(120.0, gt=0)
    lock_ttl: float = Field(120.0, gt=0)
    prefix_index_entries: int = Field(100_000, ge=0)
    """Prefix block keys remembered (LRU) for routing warm requests to the replica that holds them."""
    canary_interval: float = Field(0.0, ge=0)
    """Seconds between coherence canary rounds over active logical IDs; 0 turns the canary off."""
    admin_token: SecretStr | None = None
    """Required (header ``x-kvgate-admin-token``) to pin a request to a replica; pinning is off without it."""

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [str(url).strip().rstrip("/") for url in value]
        return value

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
