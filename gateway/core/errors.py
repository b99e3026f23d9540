"""Every error kvgate raises, in one tree.

    KvgateError                      500 internal_error
    ├── BadRequest                   400 invalid_request_error
    │   └── BodyTooLarge             413 invalid_request_error
    ├── Unauthorized                 401 authentication_error   (admin surface without the token)
    ├── ModelNotFound                404 not_found_error        (unknown logical ID)
    ├── InvalidAdapter               400 invalid_adapter        (publish refuses a directory)
    ├── VersionNotFound              404 not_found_error        (rollback to a digest never published)
    ├── EpochTableError              500 internal_error         (a Lua script answered an unknown code)
    ├── UpstreamError                502 upstream_error
    │   ├── BackendUnreachable       502 upstream_error         (connect/reset before the first byte)
    │   ├── BackendTimeout           504 upstream_timeout
    │   └── LoadFailed               502 upstream_error         (a replica refused a load/unload/purge)
    ├── NoEligibleReplica            503 service_unavailable    (nothing healthy, or the load failed)
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


class Unauthorized(KvgateError):
    status = 401
    type = "authentication_error"


class ModelNotFound(KvgateError):
    status = 404
    type = "not_found_error"


class InvalidAdapter(KvgateError):
    status = 400
    type = "invalid_adapter"


class VersionNotFound(KvgateError):
    status = 404
    type = "not_found_error"


class EpochTableError(KvgateError):
    pass


class UpstreamError(KvgateError):
    status = 502
    type = "upstream_error"


class BackendUnreachable(UpstreamError):
    pass


class BackendTimeout(UpstreamError):
    status = 504
    type = "upstream_timeout"


class LoadFailed(UpstreamError):
    """A replica refused or failed a load, unload or purge; ``reason`` is its own words."""

    def __init__(self, reason: str, backend_status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.backend_status = backend_status


class NoEligibleReplica(KvgateError):
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
