"""Optionally put the API's documentation and metrics behind the same bearer tokens as
the API (`FLEET_PROTECT_DOCS=1`, `FLEET_PROTECT_METRICS=1`): the OpenAPI schema maps
every admin route, and metrics name deployments, clusters and keys' traffic."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from control_plane.api.auth import authenticate


def docs_urls(protect: bool) -> dict:
    """FastAPI(...) arguments: the stock open routes, or none (added by `install` below)."""
    return {"docs_url": None, "redoc_url": None, "openapi_url": None} if protect else {}


def install_docs(app: FastAPI) -> None:
    """/openapi.json and /docs that need a bearer token with the read or admin scope."""
    auth = [Depends(authenticate)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def docs(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")
