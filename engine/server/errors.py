"""The OpenAI error shape, and handlers that turn every failure into it.

Client mistakes become 4xx with a message a person can act on; only genuine server faults
become 5xx. FastAPI's default 422 for validation is replaced by OpenAI's 400.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, EngineError, PromptTooLongError, QueueFullError

logger = logging.getLogger("engine.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client sees in OpenAI's shape; raise it from anywhere in a request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code), status_code=err.status, headers=err.headers
    )


def context_error(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, param: str) -> APIError:
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_prompt_tokens} prompt tokens, which leaves no room for the completion. "
            "Please shorten the prompt."
        )
    else:
        message = str(PromptTooLongError(num_prompt_tokens, max_tokens, max_model_len))
    return APIError(400, message, param=param, code="context_length_exceeded")


def engine_error(err: BaseException, param: str | None = None, retry_after_s: int = 1) -> APIError | None:
    """The client-facing form of an error the engine raised; None = a server fault."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, PromptTooLongError):
        return context_error(err.max_model_len, err.num_prompt_tokens, err.max_tokens, param or "prompt")
    if isinstance(err, QueueFullError):
        return APIError(
            429,
            f"The server's request queue is full; retry after {retry_after_s} s. ({err})",
            code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(err, EngineDeadError):
        return APIError(503, f"The engine has stopped and this replica must be restarted: {err}")
    if isinstance(err, ValueError):
        return APIError(400, str(err), param=param)
    return None


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'role') -> 'messages.0.role'; drops the union-member tags Pydantic adds."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in str(p) and str(p) not in _TAGS)]
    parts = [p for p in parts if p != "body"]
    return ".".join(parts) or None


_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "none"}


def validation_error(errors: list[Any]) -> APIError:
    """The most specific Pydantic error, phrased for a person."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return APIError(400, f"The request body is not valid JSON: {detail}", code="invalid_json")
    if first.get("type") == "model_type" and not first.get("loc"):
        return APIError(400, "The request body must be a JSON object", code="invalid_json")
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _loc_to_param(tuple(best.get("loc", ())))
    msg = str(best.get("msg", "invalid value")).removeprefix("Value error, ")
    if best.get("type") == "missing":
        text = f"'{param}' is a required field"
    elif param:
        shown = repr(best.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        text = f"Invalid value for '{param}': {msg} (got {shown})"
    else:
        text = msg
    return APIError(400, text, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = str(exc.detail) if exc.detail else "HTTP error"
        if exc.status_code == 404:
            message = f"Not found: {request.url.path} (this server serves /v1/models, /v1/completions, "
            message += "/v1/chat/completions, /tokenize, /detokenize, /health, /metrics)"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    async def on_engine(_: Request, exc: Exception) -> JSONResponse:
        mapped = engine_error(exc)
        return error_response(mapped or APIError(500, f"Internal engine error: {exc}"))

    async def on_unhandled(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request", exc_info=exc)
        return error_response(APIError(500, f"Internal server error: {type(exc).__name__}"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(EngineError, on_engine)
    app.add_exception_handler(Exception, on_unhandled)
