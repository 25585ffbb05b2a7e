"""One error shape for every failure of the admin API:
`{"error": {"message": ..., "type": ..., "field": ...}}`, with the status code saying
which kind (400 bad JSON, 401, 403, 404, 409, 413, 422). Client mistakes never become 500s."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "validation_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.type = type or TYPES.get(status, "error")


def not_found(what: str, name: Any) -> ApiError:
    return ApiError(404, f"{what} {name!r} not found")


def conflict(message: str, field: str | None = None) -> ApiError:
    return ApiError(409, message, field)


def invalid(field: str, message: str) -> ApiError:
    return ApiError(422, f"{field}: {message}", field)


def error_body(status: int, message: str, field: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or TYPES.get(status, "error"), "field": field}}


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(status, message, field), status_code=status, headers=headers)


def _field_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "[key]")]
    return ".".join(parts) or None


def _validation_response(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            reason = err.get("ctx", {}).get("error", "malformed JSON")
            return error_response(400, f"request body is not valid JSON: {reason}")
    messages = []
    first_field = None
    for err in errors:
        field = _field_of(tuple(err.get("loc", ())))
        first_field = first_field or field
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "required"
        messages.append(f"{field}: {msg}" if field else msg)
    if not messages:
        messages = ["invalid request"]
    return error_response(422, "; ".join(messages), first_field)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(
            error_body(exc.status, exc.message, exc.field, exc.type), status_code=exc.status, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(IntegrityError)
    async def _integrity(_request: Request, exc: IntegrityError) -> JSONResponse:
        # Two writers raced (two PATCHes minting the same version, say): the loser retries.
        log.info("conflicting concurrent write: %s", exc.orig)
        return error_response(409, "a concurrent change conflicted with this one; retry the request")

    @app.exception_handler(DataError)
    async def _data(_request: Request, exc: DataError) -> JSONResponse:
        # A value the database cannot hold that validation let through (a NUL in a text on
        # PostgreSQL): the request is at fault, not the server.
        log.info("value refused by the database: %s", exc.orig)
        reason = str(exc.orig).splitlines()[0] if exc.orig is not None else "invalid value"
        return error_response(400, f"a value in the request cannot be stored: {reason}")

    @app.exception_handler(OperationalError)
    async def _operational(_request: Request, exc: OperationalError) -> JSONResponse:
        text = str(exc.orig).lower()
        if any(s in text for s in ("locked", "could not serialize", "deadlock")):
            log.info("write lost a lock race: %s", exc.orig)
            return error_response(409, "a concurrent change held the data; retry the request")
        log.exception("database error: %s", exc)
        return JSONResponse(error_body(500, "internal error", type="internal_error"), status_code=500)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", exc)
        return JSONResponse(error_body(500, "internal error", type="internal_error"), status_code=500)
