"""The OpenAI error shape, and handlers that turn every failure into it.

Client mistakes become 4xx with a message a person can act on; only genuine server faults
become 5xx. FastAPI's default 422 for validation is replaced by OpenAI's 400.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    AdapterUnavailableError,
    EngineDeadError,
    EngineError,
    PromptTooLongError,
    QueueFullError,
    SlowReaderError,
    StepFailedError,
    UnknownAdapterError,
)
from fleet_base.openai_contract.continuation import SLOW_READER_CODE
from fleet_base.openai_contract.errors import OpenAIError, error_body, validation_error

__all__ = ["APIError", "context_error", "engine_error", "error_body", "error_response", "validation_error"]

logger = logging.getLogger("engine.server")

# On a 5xx that is this request's own failure: retrying it elsewhere would only repeat it.
NO_RETRY_HEADER = "X-Fleet-No-Retry"
NO_RETRY = {NO_RETRY_HEADER: "1"}

# The contract's error: raise it from anywhere in a request (the gateway raises the same one).
APIError = OpenAIError


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
    if isinstance(err, StepFailedError):
        return APIError(
            500, f"This request failed inside the engine: {err}", code="request_failed", headers=NO_RETRY
        )
    if isinstance(err, AdapterUnavailableError):
        return APIError(503, str(err), param="model", code="adapter_unavailable")
    if isinstance(err, SlowReaderError):
        return APIError(
            408, f"This stream was ended because its client stopped reading: {err}", code=SLOW_READER_CODE
        )
    if isinstance(err, EngineDeadError):
        return APIError(503, f"The engine has stopped and this replica must be restarted: {err}")
    if isinstance(err, UnknownAdapterError):
        return APIError(404, str(err), param="model", code="model_not_found")
    if isinstance(err, ValueError):
        return APIError(400, str(err), param=getattr(err, "param", None) or param)
    return None


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
            message += "/v1/chat/completions, /v1/embeddings, /v1/responses, /tokenize, /detokenize, /health, /metrics)"
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
