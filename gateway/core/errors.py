"""Every error kvgate raises, in one tree.

    KvgateError                      500 internal_error
    ├── BadRequest                   400 invalid_request_error
    │   ├── BodyTooLarge             413 invalid_request_error
    │   └── RequestTimeout           408 invalid_request_error  (headers or body not sent within the deadline)
    ├── TooManyConnections           429 rate_limit_error       (a client address over its connection cap)
    ├── ClientClosed                 499 client_closed          (the client left mid-request: nothing is sent)
    ├── Unauthorized                 401 authentication_error   (no valid API key; admin surface, no token)
    ├── ModelNotFound                404 not_found_error        (unknown logical ID, or not the caller's)
    ├── CallerNotFound               404 not_found_error        (revoke of an API key id that does not exist)
    ├── KeysUnavailable              503 service_unavailable    (API keys on, key table unread for too long)
    ├── InvalidAdapter               400 invalid_adapter        (publish refuses a directory)
    ├── VersionNotFound              404 not_found_error        (rollback to a digest never published)
    ├── RolloutConflict              409 conflict_error         (a rollout runs, none does, or it is current)
    ├── EpochTableError              500 internal_error         (a Lua script answered an unknown code)
    │   ├── MalformedRow             500 internal_error         (a row Redis holds is not what kvgate writes)
    │   └── ScriptRefused            500 internal_error         (a script met such a row: nothing written)
    ├── UpstreamError                502 upstream_error
    │   ├── BackendUnreachable       502 upstream_error         (connect/reset before the first byte)
    │   ├── BackendTimeout           504 upstream_timeout
    │   ├── LoadFailed               502 upstream_error         (a replica refused a load/unload/purge)
    │   └── MalformedAnswer          502 upstream_error         (a replica's answer kvgate cannot read)
    ├── NoEligibleReplica            503 service_unavailable    (nothing healthy, or the load failed)
    │   ├── VersionUnloading         503 service_unavailable    (another kvgate is unloading it there)
    │   ├── AdapterBudgetFull        503 service_unavailable    (every adapter slot stayed in use too long)
    │   ├── VersionForgotten         503 service_unavailable    (a replica lost a version kvgate loaded)
    │   └── AdapterNotReady          503 service_unavailable    (a replica's agent could not fetch and
    │                                                            verify the version's bytes)
    ├── StoreUnavailable             503 service_unavailable    (the object store failed or is unreachable)
    │   ├── BadManifest              503 service_unavailable    (a stored manifest is not what kvgate wrote)
    │   └── FetchFailed              503 service_unavailable    (an agent could not fetch and verify a
    │                                                            version; ``code``: what went wrong)
    ├── ShuttingDown                 503 service_unavailable    (this kvgate is draining: try another)
    ├── TableUnavailable             503 service_unavailable    (Redis failed or does not answer; the
    │                                                            embedded one is owned by another kvgate)
    ├── ReplicaBusy                  503 service_unavailable    (no free connection to the replica in time)
    ├── AuditError                   502 audit_error            (the audit could not run: no verdict)
    └── ReplicaStartError            500 internal_error         (a vLLM replica kvgate starts did not come up)

Each error knows its HTTP status and renders an OpenAI-style body:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.
"""

from __future__ import annotations

import json
from typing import ClassVar


class KvgateError(Exception):
    status: int = 500
    type: ClassVar[str] = "internal_error"
    headers: dict[str, str] | None = None  # response headers the error needs (``Allow`` on a 405)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, str | int | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


class BadRequest(KvgateError):
    status = 400
    type = "invalid_request_error"


class BodyTooLarge(BadRequest):
    status = 413


class RequestTimeout(BadRequest):
    """The client did not send its request's headers, or its whole body, within the deadline."""

    status = 408

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout")


class TooManyConnections(KvgateError):
    """A client address already holds ``max_connections_per_client`` open connections."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="too_many_connections")


class ClientClosed(KvgateError):
    """The client closed its connection mid-request (499, as nginx counts it); no answer can reach it.

    Raised where kvgate fails to write to the client, so that a departed client is never taken for a
    failing replica: the upstream request is closed (the replica stops generating), nothing is retried.
    """

    status = 499
    type = "client_closed"


class Unauthorized(KvgateError):
    status = 401
    type = "authentication_error"


class ModelNotFound(KvgateError):
    status = 404
    type = "not_found_error"


class ResponseNotFound(KvgateError):
    """A ``/v1/responses`` id kvgate did not mint, whose replica left the pool, or that the caller may not
    see (the same answer for all three)."""

    status = 404
    type = "not_found_error"


class CallerNotFound(KvgateError):
    status = 404
    type = "not_found_error"


class KeysUnavailable(KvgateError):
    """kvgate could not read the API key table for longer than ``auth_max_staleness``: a revoke made
    meanwhile might not be seen yet, so no key is trusted until the table answers again."""

    status = 503
    type = "service_unavailable"


class InvalidAdapter(KvgateError):
    status = 400
    type = "invalid_adapter"


class VersionNotFound(KvgateError):
    status = 404
    type = "not_found_error"


class RolloutConflict(KvgateError):
    """A rollout operation the table's state refuses: another candidate runs (or a publish meets one), no
    rollout runs to change, promote or abort, or the candidate's bytes are already current."""

    status = 409
    type = "conflict_error"


class EpochTableError(KvgateError):
    pass


class MalformedRow(EpochTableError):
    """One row Redis holds (a change-log entry, an API key, a state hash) is not what kvgate's scripts
    write: a direct write, a truncation. That row is skipped, logged and counted; the rest is read."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed row: {reason}")
        self.reason = reason


class ScriptRefused(EpochTableError):
    """A Lua script refused a change before its first write (``CODE.MALFORMED``): something it reads in
    Redis is not what the scripts write (a key of another type, a junk number, the change log at its last
    possible id). Nothing was written; the message names what is odd."""

    def __init__(self, why: str) -> None:
        super().__init__(f"refused, nothing written: Redis holds what kvgate's scripts do not write: {why}")
        self.reason = why


class UpstreamError(KvgateError):
    status = 502
    type = "upstream_error"


class BackendUnreachable(UpstreamError):
    pass


class ReplicaGoingDown(BackendUnreachable):
    """A replica answered an error as it went down (it answers its listing no more): vLLM stopping
    answers its last requests 500 "cannot schedule new futures after shutdown". Retried on another
    replica like an unreachable one; with none left, a 503 that says so, never the replica's 500."""

    status = 503
    type = "service_unavailable"


class BackendTimeout(UpstreamError):
    status = 504
    type = "upstream_timeout"


class LoadFailed(UpstreamError):
    """A replica refused or failed a load, unload or purge; ``reason`` is its own words."""

    def __init__(self, reason: str, backend_status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.backend_status = backend_status


class MalformedAnswer(UpstreamError):
    """A replica answered, but not in a form kvgate can read: not UTF-8, not JSON, nested too deep, the
    wrong shape, a metric that is not a number. Raised only by the readers in ``fleet/backends/answers.py``;
    ``reason`` is short and says which. The replica is marked (unhealthy, or not fingerprinted) with it."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"malformed answer from the replica: {reason}")
        self.reason = reason


class NoEligibleReplica(KvgateError):
    status = 503
    type = "service_unavailable"


class AdapterNotReady(NoEligibleReplica):
    """A replica's ``kvgate agent`` could not fetch and verify a version's bytes (changed, truncated or
    missing objects, the object store unreachable, a full disk, the agent unreachable). The message names
    the logical ID only; the versioned name, the replica and the object keys go to the log."""

    def __init__(self, logical_id: str, why: str) -> None:
        super().__init__(
            f"adapter {logical_id!r} is not available right now: {why}", code="adapter_not_ready"
        )
        self.why = why


class StoreUnavailable(KvgateError):
    """The object store failed a read or write kvgate needed, or could not be reached."""

    status = 503
    type = "service_unavailable"


class VersionUnloading(NoEligibleReplica):
    """A kvgate is unloading the version from the chosen replica: no request may start on it there."""


class AdapterBudgetFull(NoEligibleReplica):
    """A version had to be loaded, but every adapter the replica may keep (``max_adapters_per_replica``)
    stayed in use by running requests for ``slot_wait_timeout``, on every replica of its base."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="adapter_budget_full")


class VersionForgotten(NoEligibleReplica):
    """A replica answered 404 for a versioned name kvgate had loaded there (it restarted, or someone
    unloaded it): kvgate reloads it and retries once; this is the answer when that fails too."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="version_forgotten")


class ShuttingDown(KvgateError):
    """This kvgate received SIGTERM: it finishes what runs and takes nothing new."""

    status = 503
    type = "service_unavailable"


class ReplicaBusy(KvgateError):
    """Every connection kvgate allows to a replica (``max_connections_per_replica``) stayed in use for
    ``pool_wait_timeout``. The replica is not at fault and stays healthy."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="replica_busy")


class TableUnavailable(KvgateError):
    """The epoch table cannot be used: its Redis failed or does not answer in time, or the embedded
    Redis of this data directory belongs to another kvgate."""

    status = 503
    type = "service_unavailable"


class AuditError(KvgateError):
    """The audit (or the canary) could not observe a replica: an error answer, a malformed one, no
    replica to audit. No verdict is drawn from it."""

    status = 502
    type = "audit_error"


class ReplicaStartError(KvgateError):
    """A replica kvgate starts itself (the demo, the tests) died or did not answer in time; the message
    ends with its log tail."""


class MalformedEvent(KvgateError):
    """A KV cache event (or the message carrying it) from a replica that is not what vLLM sends: counted
    and skipped at the boundary (``kv.events``), never stopping the subscriber."""


class Unrenderable(KvgateError):
    """A prompt kvgate cannot render exactly as vLLM would (``kv.chat_messages``, ``kv.prompt_tokens``; the
    message is a short reason label). Never answered to a client: the request is counted under that reason
    and routed on the predicted index."""
