"""Errors of the HTTP API, in the OpenAI error format, and the handlers that render them.

Every failure a client can cause becomes `{"error": {"message", "type", "param", "code"}}`
with the matching HTTP status; the server never answers with a traceback and keeps serving.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgebuild.errors import RequestError

log = logging.getLogger("edgebuild.serve")

# status -> OpenAI error `type`
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A client-visible error: HTTP status + OpenAI error body.

    Args:
        status: HTTP status code.
        message: what is wrong and how to fix it.
        param: the offending request field, when there is one.
        code: a short machine-readable code (`model_not_found`, `queue_full`, ...).
        retry_after: seconds a client should wait before retrying (429 / 503): sent as the
            `Retry-After` header.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code=None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        """The response headers this error adds (`Retry-After`)."""
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    """`{"error": {...}}` for `status` (type derived from the status)."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 `invalid_request_error`."""
    return APIError(400, message, param, code)


def from_request_error(exc: RequestError, param: str | None = None) -> APIError:
    """A runtime RequestError (bad sampling params, prompt too long...) as a 400."""
    return APIError(400, str(exc), param, "invalid_request")


def install_handlers(app: FastAPI) -> None:
    """Render APIError, validation and HTTP errors (and anything unexpected) as OpenAI errors."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError):
        return JSONResponse(error_body(400, str(exc), None, "invalid_request"), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error while serving a request")
        return JSONResponse(
            error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500
        )
