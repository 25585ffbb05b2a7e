"""The operator console at /console: server-rendered Jinja2 pages with htmx (live
fragments) and uPlot charts, all vendored under static/ so nothing loads from elsewhere.
Same tokens as the admin API (admin may act, read only looks), held in a session cookie.
See docs/console.md."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from control_plane.console import pages, routes
from control_plane.console.web import PACKAGE, CsrfFailed, LoginRequired, login_required_response


def install(app: FastAPI) -> None:
    app.mount("/console/static", StaticFiles(directory=str(PACKAGE / "static")), name="console-static")
    app.include_router(routes.router)
    app.include_router(pages.router)
    app.add_exception_handler(LoginRequired, lambda request, exc: login_required_response(request))
    app.add_exception_handler(CsrfFailed, routes.csrf_failed)
