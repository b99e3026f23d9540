"""Backend dialects: how to list, load and unload adapters on one kind of server, and name its cache."""

from gateway.backends.base import AdapterListing, BackendDialect, LoadFailed
from gateway.backends.vllm import VllmDialect

__all__ = ["AdapterListing", "BackendDialect", "LoadFailed", "VllmDialect"]
