"""The admin surface: the token check, the admin-only request options (pin, cold namespace), and the
views (``/kvgate/status``, ``/v1/models``). Off without a configured admin token.

When the admin surface has a listener of its own (``admin_port``), the public listener's app is marked
``ADMIN_SURFACE = False``: the token is refused there, whatever it is. A pin names a replica by its id
(``x-kvgate-replica``) or its URL."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from gateway.core.base_print import short
from gateway.core.errors import BadRequest, Unauthorized
from gateway.core.identity import base_name
from gateway.core.prefix import PrefixIndex
from gateway.core.split import rollout_view
from gateway.core.wire import ADMIN_TOKEN_HEADER, NAMESPACE_HEADER, PIN_HEADER, replica_id
from gateway.fleet.base_prints import base_status, disagreements
from gateway.fleet.leases import Leases
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import Replica, ReplicaPool
from gateway.table.callers import Caller, may_use, may_use_base
from gateway.table.snapshot import Snapshot

ADMIN_SURFACE = web.AppKey("admin_surface", bool)
"""Whether an app's listener serves the admin surface (absent: it does)."""


@dataclass(frozen=True, slots=True)
class AdminOptions:
    pin: Replica | None  # audits pin a request to one replica
    cold: bool  # audits ask for a fresh cache namespace


NO_OPTIONS = AdminOptions(None, False)


class Admin:
    def __init__(
        self,
        token: str | None,
        snapshot: Snapshot,
        pool: ReplicaPool,
        index: PrefixIndex,
        *,
        leases: Leases,
        quarantine: Quarantine,
        extra_fields: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.token = token
        self.snapshot = snapshot
        self.pool = pool
        self.index = index
        self.leases = leases
        self.quarantine = quarantine
        self.extra_fields = extra_fields  # more of the status document (the status page's usage and audits)

    def check(self, request: web.Request, *, bearer: bool = False) -> None:
        """A constant-time token check of UTF-8 bytes; always refused when kvgate has no admin token.
        ``bearer``: ``Authorization: Bearer <admin token>`` will do too (what Prometheus can send).

        aiohttp hands over header bytes that are not UTF-8 as surrogate escapes: such a header is refused
        (it never matches, whatever the configured token holds), and it is never an error of kvgate's.
        """
        if not request.app.get(ADMIN_SURFACE, True):
            raise Unauthorized("the admin surface is served on kvgate's admin listener only")
        header = request.headers.get(ADMIN_TOKEN_HEADER, "")
        if not header and bearer:
            scheme, _, header = request.headers.get("Authorization", "").partition(" ")
            header = header.strip() if scheme.lower() == "bearer" else ""
        given, expected = _utf8(header), self.token
        if (
            expected is None
            or given is None
            or not hmac.compare_digest(given, expected.encode("utf-8", "surrogatepass"))
        ):
            raise Unauthorized(
                f"this needs a valid {ADMIN_TOKEN_HEADER} (and kvgate started with an admin token)"
            )

    def allows(self, request: web.Request) -> bool:
        """Whether the request carries the admin token where the admin surface is served (``check``,
        also as ``Authorization: Bearer``), without refusing it: ``/healthz``'s detail view."""
        try:
            self.check(request, bearer=True)
        except Unauthorized:
            return False
        return True

    def check_scrape(self, request: web.Request, *, public: bool) -> None:
        """``/metrics``: its series are labelled by logical ID (the tenants), so on the public listener
        (no ``admin_port``) it takes the admin token, also as ``Authorization: Bearer`` (what a Prometheus
        scrape config's ``authorization`` sends); on the admin listener of its own it is open."""
        if public:
            self.check(request, bearer=True)

    def options(self, request: web.Request) -> AdminOptions:
        """The pin and cold-namespace headers; either one needs the admin token."""
        pin_url = request.headers.get(PIN_HEADER)
        cold = request.headers.get(NAMESPACE_HEADER) == "cold"
        if pin_url is None and not cold:
            return NO_OPTIONS
        self.check(request)
        if pin_url is None:
            return AdminOptions(None, cold)
        for replica in self.pool.replicas:
            if pin_url.rstrip("/") in (replica.url, replica_id(replica.url)):
                return AdminOptions(replica, cold)
        raise BadRequest(f"{PIN_HEADER}: {pin_url!r} is not one of this pool's replicas")

    async def status(self, request: web.Request) -> web.Response:
        """What this kvgate serves and what each replica reports."""
        self.check(request)
        versions = {
            s.logical_id: {"digest": s.digest, "name": s.name, "epoch": s.epoch, "base": s.base,
                           "path": s.path, "base_print": short(self.pool.expected_print(s)),
                           "rollout": rollout_view(s)}
            for s in self.snapshot
        }  # fmt: skip
        replicas = [
            {"id": replica_id(r.url), "url": r.url, "healthy": r.healthy,
             "unhealthy_reason": r.unhealthy_reason or None, "in_flight": r.in_flight,
             "base": r.listing.base_name, "max_model_len": r.listing.max_model_len,
             "adapters": r.listing.adapters, **base_status(self.pool, r, self.snapshot)}
            for r in self.pool.replicas
        ]  # fmt: skip
        doc = {
            "generation": self.snapshot.generation,
            "snapshot_flushed": self.snapshot.flushed,
            "snapshot_staleness_s": self.snapshot.staleness(),
            "malformed_rows": self.snapshot.malformed,
            "versions": versions,
            "replicas": replicas,
            "base_disagreements": disagreements(self.pool),
            "prefix_index_entries": len(self.index),
            "gateway_id": self.leases.gateway_id,
            "leases": [{"replica": url, "name": name} for url, name in sorted(self.leases.held())],
            "quarantined": [asdict(finding) for finding in self.quarantine.findings()],
            **(self.extra_fields() if self.extra_fields else {}),
        }
        return web.json_response(doc)


def _utf8(text: str) -> bytes | None:
    """``text`` as UTF-8, or None when it holds surrogates (bytes that were not UTF-8)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


def list_models(snapshot: Snapshot, bases: list[str], caller: Caller | None = None) -> web.Response:
    """``/v1/models``: the base models the pool serves and every logical ID (never a versioned name),
    each with the base it was published for as its parent; for a caller with an API key, only what it
    may use."""
    allowed = sorted(
        (state.logical_id, base_name(state.base)) for state in snapshot if may_use(caller, state.logical_id)
    )
    served = [(base_name(base), None) for base in bases] if may_use_base(caller) else []
    ids = [*served, *allowed]
    data = [
        {"id": model, "object": "model", "created": 0, "owned_by": "kvgate", "parent": parent}
        for model, parent in ids
    ]
    return web.json_response({"object": "list", "data": data})
