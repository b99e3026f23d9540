"""The caller stage: who is asking, before anything else is read.

With API keys off (the default) everyone may use everything, as before. With ``auth = "api-keys"``:

- ``Authorization: Bearer <key>`` names the caller: its tenant and the logical IDs (and the base model)
  it may use. The key is looked up in this kvgate's local copy of the key table (``Callers``), never in
  Redis on the request path. A missing or unknown key is 401 (``authentication_error``).
- A valid admin token (``x-kvgate-admin-token``, where the admin surface is served) stands for the
  operator: every logical ID, as with keys off (audits pin and ask for cold namespaces with it).
- What a caller may not use does not exist for it: ``not_found`` answers exactly like an unknown ID.
"""

from __future__ import annotations

from aiohttp import web

from gateway.core.errors import ModelNotFound, Unauthorized
from gateway.core.wire import ADMIN_TOKEN_HEADER, AUTHORIZATION_HEADER
from gateway.request.admin import Admin
from gateway.table.callers import Caller, Callers


class Auth:
    def __init__(self, callers: Callers | None, admin: Admin) -> None:
        self.callers = callers  # None: API keys are off
        self.admin = admin

    @property
    def on(self) -> bool:
        return self.callers is not None

    def caller(self, request: web.Request) -> Caller | None:
        """The caller, or None for no restriction (keys off, or the operator); 401 for no valid key."""
        if self.callers is None:
            return None
        if ADMIN_TOKEN_HEADER in request.headers:
            self.admin.check(request)  # a wrong token is 401, never a fallback to the key
            return None
        scheme, _, key = request.headers.get(AUTHORIZATION_HEADER, "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized(
                "You didn't provide an API key: send it as `Authorization: Bearer <key>`.",
                code="missing_api_key",
            )
        caller = self.callers.find(key.strip())
        if caller is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return caller


def not_found(model: str) -> ModelNotFound:
    """The one answer for a model that does not exist, or does not exist for this caller."""
    return ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
