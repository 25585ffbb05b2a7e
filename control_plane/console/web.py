"""Shared plumbing of the console's routes: templates, the session dependency, CSRF checks
and the security headers every console response carries."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from control_plane.console import session as sessions
from control_plane.console.data import iso
from control_plane.console.worldmap import HEIGHT, WIDTH

PACKAGE = Path(str(resources.files("control_plane.console")))
templates = Jinja2Templates(directory=str(PACKAGE / "templates"))
templates.env.filters["iso"] = iso
templates.env.globals.update(map_width=WIDTH, map_height=HEIGHT)

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class LoginRequired(Exception):
    """No live session: pages redirect to the login, fragments and data answer 401."""


def secure(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    session = getattr(request.state, "console", None)
    response = templates.TemplateResponse(
        request,
        template,
        {"session": session, "csrf": session.csrf if session else "", **context},
        status_code=status_code,
    )
    return secure(response)  # type: ignore[return-value]


def require(request: Request) -> sessions.ConsoleSession:
    """Dependency of every console route but the login."""
    session = sessions.current(request)
    if session is None:
        raise LoginRequired
    request.state.console = session
    return session


def login_required_response(request: Request) -> Response:
    path = request.url.path
    fragment = (
        request.headers.get("hx-request")
        or path.endswith((".json", "/panel"))
        or "/panel/" in path
        or request.query_params.get("fragment")
    )
    if request.method == "GET" and not fragment:
        target = "/console/login" + (f"?next={path}" if path.startswith("/console") else "")
        return secure(RedirectResponse(target, status_code=303))
    response = Response("login required", status_code=401, media_type="text/plain")
    response.headers["HX-Redirect"] = "/console/login"
    return secure(response)


async def check_csrf(request: Request, session: sessions.ConsoleSession) -> dict[str, str]:
    """The form's fields, once its CSRF token (field or header) matched the session's."""
    form = await request.form()
    given = form.get(sessions.CSRF_FIELD) or request.headers.get(sessions.CSRF_HEADER)
    if not sessions.csrf_ok(session.csrf, given if isinstance(given, str) else None):
        raise CsrfFailed
    return {k: v for k, v in form.items() if isinstance(v, str)}


class CsrfFailed(Exception):
    """A console form without the session's CSRF token: 403, nothing done."""


def safe_next(value: str | None) -> str:
    """Only a path inside the console (never another site: no scheme, no `//`)."""
    if not value or not value.startswith("/console") or "//" in value or "\\" in value:
        return "/console"
    return value
