"""Bearer-token auth for the admin API.

Tokens are API keys (`fleet-<key_id>-<secret>`): the id finds the row, the salted hash
proves the secret. Scope `admin` may do everything, `read` only GET, `inference`
nothing here. Verified tokens are cached for `CACHE_TTL_S` so a busy CLI does not hash
and query per request; a revoke through this process drops the entry at once, one
through another process takes effect within the TTL.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

from fastapi import Request

from control_plane.api.errors import ApiError
from control_plane.db.models import ApiKey
from fleet_base.api_keys import key_id_of, verify_secret

CACHE_TTL_S = 1.0
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Principal:
    key_id: str
    name: str
    scopes: tuple[str, ...]

    @property
    def actor(self) -> str:
        return f"{self.name} ({self.key_id})"

    def may(self, method: str) -> bool:
        if "admin" in self.scopes:
            return True
        return method in READ_METHODS and "read" in self.scopes


class TokenCache:
    def __init__(self, ttl_s: float = CACHE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, Principal]] = {}

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def get(self, token: str) -> Principal | None:
        with self._lock:
            entry = self._entries.get(self._digest(token))
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, token: str, principal: Principal) -> None:
        with self._lock:
            if len(self._entries) > 10_000:
                self._entries.clear()
            self._entries[self._digest(token)] = (time.monotonic() + self.ttl_s, principal)

    def invalidate(self, key_id: str) -> None:
        with self._lock:
            for digest in [d for d, (_, p) in self._entries.items() if p.key_id == key_id]:
                del self._entries[digest]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message)


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise _unauthorized("missing Authorization: Bearer <token>")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("Authorization must be 'Bearer <token>'")
    return token


def verify(sessions, cache: TokenCache, token: str) -> Principal:
    cached = cache.get(token)
    if cached is not None:
        return cached
    key_id = key_id_of(token) if len(token) <= 256 else None
    if key_id is None:
        raise _unauthorized("invalid token")
    with sessions() as session:
        row = session.get(ApiKey, key_id)
        if row is None or row.revoked_at is not None or not verify_secret(token, row.salt, row.hash):
            raise _unauthorized("invalid or revoked token")
        principal = Principal(row.key_id, row.name, tuple(row.scopes or ()))
    cache.put(token, principal)
    return principal


def authenticate(request: Request) -> Principal:
    """FastAPI dependency of every /v1 route (runs in the threadpool: it may query)."""
    state = request.app.state
    principal = verify(state.ctx.sessions, state.token_cache, bearer_token(request))
    if not principal.may(request.method):
        need = "admin" if request.method not in READ_METHODS else "read or admin"
        raise ApiError(
            403, f"key {principal.key_id} lacks scope {need} for {request.method} {request.url.path}"
        )
    request.state.principal = principal
    return principal
