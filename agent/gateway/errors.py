"""OpenAI's error shape for everything the gateway itself refuses.

Same body as the engine's (`{"error": {"message", "type", "param", "code"}}`) so a client
cannot tell whether the gateway or a replica answered a bad request.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


class GatewayError(Exception):
    """A refusal the client sees in OpenAI's shape; raise it anywhere in a request."""

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
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: GatewayError, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code)).encode()
    return Response(
        body,
        status_code=err.status,
        media_type="application/json",
        headers={**err.headers, **(headers or {})},
    )


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An in-band error for a stream whose headers are already sent (OpenAI clients raise it)."""
    return b"data: " + json.dumps(error_body(status, message, None, code)).encode() + b"\n\n"
