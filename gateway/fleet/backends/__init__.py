"""Backend dialects: how to list, load and unload adapters on one kind of server, and name its cache."""

from gateway.core.errors import LoadFailed
from gateway.fleet.backends.base import AdapterListing, BackendDialect, fetch_model_list
from gateway.fleet.backends.generic import GenericOpenAIDialect
from gateway.fleet.backends.sglang import SglangDialect
from gateway.fleet.backends.vllm import VllmDialect

DIALECTS = ("vllm", "sglang", "generic")
"""The names ``dialect_for`` accepts."""


def start_warnings(dialect: BackendDialect) -> list[str]:
    """What kvgate cannot do on ``dialect``'s servers, for warnings at start (empty: nothing)."""
    warnings = []
    if not dialect.runtime_loading:
        warnings.append(
            f"{dialect.name} replicas cannot load adapters at runtime: kvgate routes a version only to "
            "replicas that list its versioned name; a new version is served once a replica is restarted "
            "with it (kvgate publish prints its name and path)"
        )
    if not dialect.cache_namespaces:
        warnings.append(
            f"{dialect.name} replicas have no cache namespace: versions stay apart by their versioned "
            "names alone, and an epoch bump cannot invalidate a replica's prefix cache"
        )
    return warnings


def dialect_for(name: str) -> BackendDialect:
    """A fresh dialect for ``name`` (one of ``DIALECTS``); ValueError for any other name."""
    if name == "vllm":
        return VllmDialect()
    if name == "sglang":
        return SglangDialect()
    if name == "generic":
        return GenericOpenAIDialect()
    raise ValueError(f"unknown backend dialect {name!r}; expected one of {', '.join(DIALECTS)}")


__all__ = [
    "DIALECTS",
    "AdapterListing",
    "BackendDialect",
    "GenericOpenAIDialect",
    "LoadFailed",
    "SglangDialect",
    "VllmDialect",
    "dialect_for",
    "fetch_model_list",
    "start_warnings",
]
