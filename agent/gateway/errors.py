"""OpenAI's error shape for everything the gateway itself refuses.

The shape and the exception come from the contract the engine server uses too
(`fleet_base.openai_contract.errors`), so a client cannot tell which of the two refused it.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from fleet_base.openai_contract.errors import OpenAIError, error_body

__all__ = ["GatewayError", "error_body", "error_response", "sse_error_event"]


class GatewayError(OpenAIError):
    """A refusal the client sees in OpenAI's shape; raise it anywhere in a request."""


def error_response(err: GatewayError, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code, err.kind)).encode()
    return Response(
        body,
        status_code=err.status,
        media_type="application/json",
        headers={**(err.headers or {}), **(headers or {})},
    )


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An in-band error for a stream whose headers are already sent (OpenAI clients raise it)."""
    return b"data: " + json.dumps(error_body(status, message, None, code)).encode() + b"\n\n"
