"""The console's writes: log in, log out, promote or abort a rollout. Each is a POST form
with a CSRF token; promote and abort go through the admin API's own route functions, so
they audit, record events and wake the loops exactly as `fleetctl rollout` does."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from control_plane.api.auth import verify
from control_plane.api.errors import ApiError
from control_plane.api.routers import rollouts
from control_plane.console import session as sessions
from control_plane.console.web import CsrfFailed, check_csrf, render, require, safe_next, secure

router = APIRouter(prefix="/console", include_in_schema=False)


def _login_page(request: Request, error: str = "", status_code: int = 200, next_: str = "") -> Response:
    token = sessions.login_csrf(request)
    response = render(
        request, "login.html", status_code=status_code, login_csrf=token, error=error, next=safe_next(next_)
    )
    sessions.set_cookie(response, sessions.LOGIN_COOKIE, token, max_age=3600)
    return response


@router.get("/login")
def login_form(request: Request, next: str = ""):
    if sessions.current(request) is not None:
        return secure(RedirectResponse(safe_next(next), status_code=303))
    return _login_page(request, next_=next)


@router.post("/login")
def login(
    request: Request,
    token: str = Form("", max_length=512),
    csrf_token: str = Form("", max_length=128),
    next: str = Form("", max_length=512),
):
    expected = request.cookies.get(sessions.LOGIN_COOKIE) or ""
    if not expected or not sessions.csrf_ok(expected, csrf_token):
        return _login_page(request, "The form expired; try again.", 403, next)
    state = request.app.state
    try:
        principal = verify(state.ctx.sessions, state.token_cache, token.strip())
    except ApiError:
        return _login_page(request, "Unknown or revoked token.", 401, next)
    if not set(principal.scopes) & set(sessions.CONSOLE_SCOPES):
        return _login_page(request, "The console needs a token with the admin or read scope.", 403, next)
    session = sessions.store(request).create(principal)
    response = secure(RedirectResponse(safe_next(next), status_code=303))
    sessions.set_cookie(response, sessions.COOKIE, session.session_id, max_age=int(sessions.SESSION_TTL_S))
    response.delete_cookie(
        sessions.LOGIN_COOKIE, path=sessions.PATH, secure=True, httponly=True, samesite="strict"
    )
    return response


@router.post("/logout")
async def logout(request: Request, session: sessions.ConsoleSession = Depends(require)):
    await check_csrf(request, session)
    sessions.store(request).drop(session.session_id)
    response = secure(RedirectResponse("/console/login", status_code=303))
    response.delete_cookie(sessions.COOKIE, path=sessions.PATH, secure=True, httponly=True, samesite="strict")
    return response


@router.post("/deployments/{name}/rollout/{action}")
async def end_rollout(
    name: str, action: str, request: Request, session: sessions.ConsoleSession = Depends(require)
):
    await check_csrf(request, session)
    if action not in ("promote", "abort"):
        return render(request, "message.html", 404, title="Not found", message=f"No action {action!r}.")
    if not session.admin:
        return render(
            request,
            "message.html",
            403,
            title="Not allowed",
            message=f"Your token ({session.principal.key_id}) is read-only: it cannot {action} rollouts.",
        )
    route = rollouts.promote_rollout if action == "promote" else rollouts.abort_rollout

    def run() -> None:
        with request.app.state.ctx.sessions() as db:
            route(name, request, db, session.principal)

    try:
        await run_in_threadpool(run)
    except ApiError as err:
        return render(request, "message.html", err.status, title="Not done", message=err.message)
    return secure(RedirectResponse(f"/console/deployments/{quote(name)}/rollout", status_code=303))


def csrf_failed(request: Request, exc: CsrfFailed) -> Response:
    return render(
        request,
        "message.html",
        403,
        title="Refused",
        message="The form had no valid CSRF token; nothing was changed. Reload the page and try again.",
    )
