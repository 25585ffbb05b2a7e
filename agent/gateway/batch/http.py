"""What the batch side's HTTP handlers share: OpenAI's error shape for every refusal (the
gateway's own helper), the key's 404 for what is not its own, and OpenAI's cursor list."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats.errors
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent.gateway.errors import GatewayError, error_response

log = logging.getLogger("agent.gateway.batch")

Handler = Callable[[Request], Awaitable[Response]]
# the store is NATS: what its client raises while the server is down or slow
STORE_DOWN = (nats.errors.Error, asyncio.TimeoutError, ConnectionError)


def store_unavailable(detail: str = "") -> GatewayError:
    return GatewayError(
        503, f"Batch storage is unavailable from this gateway{detail}; try again", code="store_unavailable"
    )


def guarded(handler: Handler) -> Handler:
    """Every `GatewayError` a handler raises answers in OpenAI's error shape; the store
    down is a 503, not an internal error."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except GatewayError as err:
            return error_response(err)
        except STORE_DOWN as err:
            log.warning("batch store unavailable on %s: %s: %s", request.url.path, type(err).__name__, err)
            return error_response(store_unavailable())

    return run


def json_of(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise GatewayError(
            400, f"'{name}' must be an integer from {low} to {high}", param=name, code="invalid_value"
        )
    return value


def cursor_page(objects: Sequence[Any], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's list: `limit` objects after the one whose id is `after`, with first_id,
    last_id and has_more (an unknown cursor is the end of the list)."""
    start = 0
    if after:
        ids = [o.id for o in objects]
        start = ids.index(after) + 1 if after in ids else len(objects)
    chunk = list(objects[start : start + limit])
    return {
        "object": "list",
        "data": [o.model_dump(mode="json") for o in chunk],
        "first_id": chunk[0].id if chunk else None,
        "last_id": chunk[-1].id if chunk else None,
        "has_more": start + limit < len(objects),
    }
