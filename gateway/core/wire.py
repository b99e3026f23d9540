"""What crosses the wire between clients, kvgate and replicas: header names and cache namespaces.

The response headers in ``EVIDENCE_HEADERS`` say which effective model answered. The admin-only request
headers pin a request to one replica or ask for a fresh (cold) cache namespace; audits use both. The
gateway's cache namespace (``cache_salt`` on vLLM) is derived here, never taken from a client: a fixed
``kvg-`` prefix and hex only, so it can never collide with a LoRA name.
"""

from __future__ import annotations

import secrets

from blake3 import blake3

from gateway.core.model import VersionState

SALT_PREFIX = "kvg-"
VERSION_HEADER = "x-kvgate-version"
DIGEST_HEADER = "x-kvgate-digest"
EPOCH_HEADER = "x-kvgate-epoch"
REPLICA_HEADER = "x-kvgate-replica"
PREFIX_KEY_HEADER = "x-kvgate-prefix-key"
EVIDENCE_HEADERS = (VERSION_HEADER, DIGEST_HEADER, EPOCH_HEADER, REPLICA_HEADER, PREFIX_KEY_HEADER)
"""Response headers that say which effective model answered."""
PIN_HEADER = "x-kvgate-pin"
NAMESPACE_HEADER = "x-kvgate-namespace"  # "cold": a fresh, throwaway cache namespace (audits)
ADMIN_TOKEN_HEADER = "x-kvgate-admin-token"
CLIENT_NAMESPACE_FIELDS = ("cache_salt", "extra_key")  # vLLM's and SGLang's: never taken from a client


def cache_salt(generation: str, version: VersionState) -> str:
    """The gateway's cache namespace for one effective model and epoch: fixed prefix, hex only."""
    key = f"{generation}\0{version.base}\0{version.digest}\0{version.epoch}".encode()
    return SALT_PREFIX + blake3(key).hexdigest()[:32]


def cold_salt() -> str:
    """A fresh, throwaway namespace: nothing cached before can match it."""
    return f"{SALT_PREFIX}cold-{secrets.token_hex(16)}"
