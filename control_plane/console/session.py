"""Console sessions: a login with an admin or read token becomes a random session id in
a Secure, HttpOnly, SameSite=Strict cookie. The token itself is verified once (by the
admin API's `verify`) and never stored, echoed or put in a page; the server keeps only
the key id, its scopes and the session's CSRF token.

Every request re-reads the key's row, so a key revoked through the API ends its console
sessions at once. Sessions live in this process's memory: a restarted control plane
asks for the token again. CSRF: every form carries the session's token (htmx sends it as
a header), compared in constant time; the login form is protected by a double-submit
cookie, since there is no session yet.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import Request, Response

from control_plane.api.auth import Principal
from control_plane.db.models import ApiKey

COOKIE = "fleet_console"
LOGIN_COOKIE = "fleet_console_login"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
PATH = "/console"
SESSION_TTL_S = 8 * 3600.0
MAX_SESSIONS = 10_000
CONSOLE_SCOPES = ("admin", "read")


@dataclass(frozen=True)
class ConsoleSession:
    session_id: str
    principal: Principal
    csrf: str
    expires_at: float

    @property
    def admin(self) -> bool:
        return "admin" in self.principal.scopes


@dataclass
class SessionStore:
    ttl_s: float = SESSION_TTL_S
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sessions: dict[str, ConsoleSession] = field(default_factory=dict)

    def create(self, principal: Principal) -> ConsoleSession:
        now = time.monotonic()
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                self._sessions = {k: s for k, s in self._sessions.items() if s.expires_at > now}
                if len(self._sessions) >= MAX_SESSIONS:  # still full: the oldest go
                    oldest = sorted(self._sessions.values(), key=lambda s: s.expires_at)
                    for s in oldest[: MAX_SESSIONS // 10]:
                        del self._sessions[s.session_id]
            session = ConsoleSession(
                secrets.token_urlsafe(32), principal, secrets.token_urlsafe(32), now + self.ttl_s
            )
            self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        if not session_id or len(session_id) > 128:
            return None
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and session.expires_at <= time.monotonic():
                del self._sessions[session_id]
                return None
        return session

    def drop(self, session_id: str | None) -> None:
        with self._lock:
            self._sessions.pop(session_id or "", None)


def store(request: Request) -> SessionStore:
    state = request.app.state
    if getattr(state, "console_sessions", None) is None:
        state.console_sessions = SessionStore()
    return state.console_sessions


def current(request: Request) -> ConsoleSession | None:
    """The request's live session, or None (no cookie, expired, or its key revoked)."""
    session = store(request).get(request.cookies.get(COOKIE))
    if session is None:
        return None
    with request.app.state.ctx.sessions() as db:
        row = db.get(ApiKey, session.principal.key_id)
        if row is None or row.revoked_at is not None:
            store(request).drop(session.session_id)
            return None
    return session


def csrf_ok(expected: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


def set_cookie(response: Response, name: str, value: str, max_age: int) -> None:
    response.set_cookie(
        name, value, max_age=max_age, path=PATH, secure=True, httponly=True, samesite="strict"
    )


def login_csrf(request: Request) -> str:
    """The login form's token: the double-submit cookie's value, or a fresh one."""
    value = request.cookies.get(LOGIN_COOKIE)
    return value if value and len(value) <= 128 else secrets.token_urlsafe(32)
