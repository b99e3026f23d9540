"""The one error boundary: the middleware that turns every error into an OpenAI-style JSON response,
and aiohttp's server log, one line per client error."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from gateway.core.errors import BadRequest, BodyTooLarge, KvgateError

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one error boundary: every error leaves as an OpenAI-style JSON body with its own status.

    An error kvgate expects (a client's, a replica's) is one log line; anything else is a bug in kvgate:
    a 500 whose body says no more than that, logged once with its traceback. Once a response has begun
    (a stream), nothing else can be sent: aiohttp closes the connection and logs the error once. A client
    that left mid-request is nobody's bug: aiohttp logs it in one line (``ServerLog``).
    """
    try:
        return await handler(request)
    except KvgateError as exc:
        error = exc
    except web.HTTPRequestEntityTooLarge:
        error = BodyTooLarge("request body is over the configured limit")
    except web.RequestPayloadError as exc:  # e.g. a body that is not what its Content-Encoding says
        error = BadRequest(f"request body could not be read: {_one_line(exc)}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = _http_error(exc)
    except ConnectionError:
        raise
    except Exception:
        if request.writer.output_size:
            raise
        log.exception("%s %r failed inside kvgate (a bug): 500", request.method, request.raw_path)
        return _error_response(KvgateError("kvgate failed on this request (an internal error, logged)"))
    log.log(
        logging.INFO if error.status < 500 else logging.WARNING,
        "%s %r: %d %s %r", request.method, request.raw_path, error.status, error.type, error.message,
    )  # fmt: skip
    return _error_response(error)


def _http_error(exc: web.HTTPException) -> KvgateError:
    error = BadRequest(exc.reason) if exc.status < 500 else KvgateError(exc.reason)
    error.status = exc.status  # aiohttp's own errors (404 route, 405 method) keep their status
    if "Allow" in exc.headers:
        error.headers = {"Allow": exc.headers["Allow"]}
    return error


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _error_response(exc: KvgateError) -> web.Response:
    return web.Response(
        body=exc.json_bytes(), status=exc.status, content_type="application/json", headers=exc.headers
    )


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log (``aiohttp.server``) as kvgate wants it: a request the HTTP parser refused
    (a client's malformed request line or header) is one line at most at INFO, not a traceback per
    connection, and so is a client that left mid-request; whatever else aiohttp logs keeps its traceback."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError | web.RequestPayloadError | ConnectionError):
            # aiohttp's message for a parse error points at the offending byte, over several lines
            broke = isinstance(exc, ConnectionError)
            detail = f"the connection broke: {exc!r}" if broke else _one_line(exc)
            msg, args = f"{msg}: %s", (*args, detail)
            kwargs["exc_info"] = None
            level = min(level, logging.INFO)
        super().log(level, msg, *args, **kwargs)
