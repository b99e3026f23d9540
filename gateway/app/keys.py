"""The typed ``AppKey`` of each component of kvgate's aiohttp application (``gateway.app.wiring`` builds them,
``gateway.app.background`` starts the background tasks that use them)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.trace import Tracer

from gateway.fleet.base_prints import BasePrints
from gateway.fleet.invalidation import PurgeAll
from gateway.fleet.leases import Leases
from gateway.fleet.loader import AdapterLoader
from gateway.fleet.quarantine import Quarantine
from gateway.fleet.replicas import ReplicaPool
from gateway.kv.live_check import LiveCheck
from gateway.kv.shared_index import SharedReader
from gateway.kv.tokenizers import Tokenizers
from gateway.kv.trust import RoutingTrust
from gateway.process.siblings import Siblings
from gateway.proof.gate import Gate
from gateway.request.admin import Admin
from gateway.request.auth import Auth
from gateway.request.drain import Drain
from gateway.request.proxy import Proxy
from gateway.settings.model import Settings
from gateway.table.callers import Callers
from gateway.table.epoch_table import EpochTable
from gateway.table.reseed import Reseeder
from gateway.table.snapshot import Snapshot
from gateway.tasks.supervisor import Supervisor
from gateway.telemetry.metrics import Metrics

SETTINGS = web.AppKey("settings", Settings)
SNAPSHOT = web.AppKey("snapshot", Snapshot)
TABLE = web.AppKey("table", EpochTable)
POOL = web.AppKey("pool", ReplicaPool)
LOADER = web.AppKey("loader", AdapterLoader)
PROXY = web.AppKey("proxy", Proxy)
METRICS = web.AppKey("metrics", Metrics)
TRACER = web.AppKey("tracer", Tracer)
PURGER = web.AppKey("purger", PurgeAll)
ADMIN = web.AppKey("admin", Admin)
DRAIN = web.AppKey("drain", Drain)
LEASES = web.AppKey("leases", Leases)
QUARANTINE = web.AppKey("quarantine", Quarantine)
ACTIVITY = web.AppKey("activity", dict[str, float])
VERDICTS = web.AppKey("verdicts", dict[str, dict[str, dict[str, Any]]])  # the canary's last, for /kvgate/
RESEEDER = web.AppKey("reseeder", Reseeder)
CALLERS = web.AppKey("callers", Callers)
AUTH = web.AppKey("auth", Auth)
ADMIN_LISTENER = web.AppKey("admin_listener", web.Application)
BASE_PRINTS = web.AppKey("base_prints", BasePrints)
SUPERVISOR = web.AppKey("supervisor", Supervisor)
PRECISE_INDEX = web.AppKey("precise_index", SharedReader)  # kv_events on: the KV indexer's shared table
KV_INDEX_FD = web.AppKey("kv_index_fd", int)  # the shared table's file; with --workers, the parent's
TOKENIZERS = web.AppKey("tokenizers", Tokenizers)  # with kv_events on: each base's tokenizer, found by itself
LIVE_CHECK = web.AppKey("live_check", LiveCheck)  # with kv_events on: answers checked against kvgate's tokens
ROUTING_TRUST = web.AppKey("routing_trust", RoutingTrust)  # kv_events on: this process's trust per replica
SIBLINGS = web.AppKey("siblings", Siblings)  # --workers: /metrics and /healthz answer for every worker
GATE = web.AppKey("gate", Gate)
