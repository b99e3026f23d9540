"""What crosses the wire between clients, kvgate and replicas: header names and cache namespaces.

The response headers in ``EVIDENCE_HEADERS`` say which effective model answered, and where (a replica's
public name: ``replica_id``, not its address, unless configured). The admin-only request headers pin a
request to one replica or ask for a fresh (cold) cache namespace; audits use both. The gateway's cache
namespaces (``cache_salt`` on vLLM) are derived here, never taken from a client: a fixed ``kvg-`` prefix
and hex only, so they can never collide with a LoRA name. With API keys on, the base model gets one
namespace per tenant (``tenant_salt``). ``/v1/responses`` ids are minted here too: they name the
replica that stores the response and the tenant that owns it (``response_id``).
"""

from __future__ import annotations

import functools
import re
import secrets

from blake3 import blake3

from gateway.core.model import Target, VersionState

SALT_PREFIX = "kvg-"
VERSION_HEADER = "x-kvgate-version"
DIGEST_HEADER = "x-kvgate-digest"
EPOCH_HEADER = "x-kvgate-epoch"
REPLICA_HEADER = "x-kvgate-replica"
PREFIX_KEY_HEADER = "x-kvgate-prefix-key"
PREFIX_MATCH_HEADER = "x-kvgate-prefix-match"  # "precise:3": the blocks the decision matched, and by what
ROLE_HEADER = "x-kvgate-rollout"  # while a rollout runs: "current" or "candidate" (which version answered)
EVIDENCE_HEADERS = (
    VERSION_HEADER,
    DIGEST_HEADER,
    EPOCH_HEADER,
    REPLICA_HEADER,
    PREFIX_KEY_HEADER,
    PREFIX_MATCH_HEADER,
    ROLE_HEADER,
)
"""Response headers that say which effective model answered."""
PIN_HEADER = "x-kvgate-pin"
NAMESPACE_HEADER = "x-kvgate-namespace"  # "cold": a fresh, throwaway cache namespace (audits)
AUDIT_HEADER = "x-kvgate-audit"  # on the rollout gate's audit requests: "GATEWAY round ROUND_MS" (who, when)
ADMIN_TOKEN_HEADER = "x-kvgate-admin-token"
CLIENT_NAMESPACE_FIELDS = ("cache_salt", "extra_key")  # vLLM's and SGLang's: never taken from a client
AUTHORIZATION_HEADER = "Authorization"  # with API keys on it carries kvgate's credential: never forwarded
REPLICA_ID_PREFIX = "r-"


@functools.lru_cache(maxsize=4096)
def cache_salt(generation: str, version: VersionState) -> str:
    """The gateway's cache namespace for one effective model and epoch: fixed prefix, hex only. The base
    fingerprint is part of the effective model (a version without one keeps its namespace of before).
    Asked on every request of a version: a pure function of its arguments, so it is cached."""
    key = f"{generation}\0{version.base}\0{version.digest}\0{version.epoch}"
    if version.base_print:
        key += f"\0{version.base_print}"
    return SALT_PREFIX + blake3(key.encode()).hexdigest()[:32]


def tenant_salt(base: str, tenant: str) -> str:
    """The base model's cache namespace for one tenant (API keys on): tenants never share base-model
    prefix blocks, so the prefix-cache timing side channel between them is closed. Domain-separated from
    ``cache_salt`` (whose key starts with a generation, never with ``tenant``)."""
    key = f"tenant\0{base}\0{tenant}".encode()
    return SALT_PREFIX + blake3(key).hexdigest()[:32]


def replica_id(url: str) -> str:
    """A replica's public name in evidence headers: short and stable (every kvgate derives the same one
    from the same URL). A hash, not a secret: it hides the address, not a guessable one."""
    return REPLICA_ID_PREFIX + blake3(url.encode()).hexdigest()[:12]


def cold_salt() -> str:
    """A fresh, throwaway namespace: nothing cached before can match it."""
    return f"{SALT_PREFIX}cold-{secrets.token_hex(16)}"


RESPONSE_ID_PREFIX = "resp_"
_MINTED_RESPONSE_ID = re.compile(
    rf"{RESPONSE_ID_PREFIX}({REPLICA_ID_PREFIX}[0-9a-f]{{12}})-([0-9a-f]{{12}})-[0-9a-f]{{32}}"
)


def response_owner(tenant: str | None) -> str:
    """Who may follow up a stored response: a tenant (API keys on), or anyone (keys off: None)."""
    return blake3(f"response\0{tenant if tenant is not None else ''}".encode()).hexdigest()[:12]


def response_id(replica_url: str, tenant: str | None) -> str:
    """A ``/v1/responses`` id kvgate mints (as vLLM's ``request_id``): it names the replica that stores
    the response and the tenant that owns it, so every kvgate sends a follow-up to that replica, for that
    tenant only, without any shared state. 32 random hex make it unguessable, as vLLM's own ids are."""
    return f"{RESPONSE_ID_PREFIX}{replica_id(replica_url)}-{response_owner(tenant)}-{secrets.token_hex(16)}"


def response_parts(response_id: str) -> tuple[str, str] | None:
    """The ``replica_id`` and owner a minted response id names; None for an id kvgate did not mint."""
    match = _MINTED_RESPONSE_ID.fullmatch(response_id)
    return (match.group(1), match.group(2)) if match is not None else None


def evidence(target: Target, replica_url: str, prefix_source: str, matched_blocks: int) -> dict[str, str]:
    """The response headers that say which effective model answered, where, and the prefix blocks the
    routing decision matched there (with their source: ``precise`` KV events, ``predicted``, ``none``)."""
    match = f"{prefix_source}:{matched_blocks}"
    headers = {REPLICA_HEADER: replica_url, PREFIX_MATCH_HEADER: match}
    if target.version is not None:
        headers[VERSION_HEADER] = target.version.name
        headers[DIGEST_HEADER] = target.version.digest
        headers[EPOCH_HEADER] = str(target.version.epoch)
    if target.role:
        headers[ROLE_HEADER] = target.role
    if target.keys:
        headers[PREFIX_KEY_HEADER] = target.keys[0].hex()
    return headers
