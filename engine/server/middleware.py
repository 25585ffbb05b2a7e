"""Pure-ASGI guards that run before routing: admission while loading/draining, auth, body size.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import APIError, error_body
from engine.server.state import ServerState

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Guarded, but not work a drain waits for: the agent's KV-event long poll.
UNCOUNTED_PATHS = frozenset({"/kv/events"})


class BodyTooLargeError(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"Request body is larger than this server's limit of {limit} bytes",
            code="request_too_large",
        )


async def _send_error(send: Send, err: APIError) -> None:
    body = json.dumps(error_body(err.status, err.message, err.param, err.code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for k, v in (err.headers or {}).items():
        headers.append((k.lower().encode(), v.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Refuses work the server cannot or must not do, and counts requests in flight."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        err = self._refusal(scope)
        if err is not None:
            await _send_error(send, err)
            return
        if scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.enter()
        try:
            await self.app(scope, self._limited(scope, receive), send)
        finally:
            self.state.leave()

    def _refusal(self, scope: Scope) -> APIError | None:
        state = self.state
        retry = {"Retry-After": str(state.settings.retry_after_s)}
        if state.draining:
            return APIError(503, "The server is shutting down; retry on another replica", headers=retry)
        key = state.settings.api_key
        if key is not None and not _authorized(scope, key):
            return APIError(
                401, "Invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
            )
        if state.engine is None:
            msg = state.load_error or "The model is still loading; retry shortly"
            return APIError(503, msg, headers=retry)
        length = _header(scope, b"content-length")
        limit = state.settings.max_request_bytes
        if length is not None:
            if not length.isdigit():
                return APIError(400, "Content-Length must be a non-negative integer")
            if int(length) > limit:
                return BodyTooLargeError(limit)
        return None

    def _limited(self, scope: Scope, receive: Receive) -> Receive:
        """Counts body bytes as they stream in, for bodies sent without Content-Length."""
        limit = self.state.settings.max_request_bytes
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError(limit)
            return message

        return wrapped


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


def _authorized(scope: Scope, key: str) -> bool:
    auth = _header(scope, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
