"""The gateway's ASGI app: routes, OpenAI-shaped errors for everything, lifespan."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent.gateway.errors import GatewayError, error_response
from agent.gateway.gateway import Gateway
from fleet_base.cluster_config import ClusterConfig

log = logging.getLogger("agent.gateway")


def build_app(config: ClusterConfig, gateway: Gateway | None = None) -> Starlette:
    gw = gateway or Gateway(config)

    async def chat(request: Request) -> Response:
        return await gw.inference(request, "chat")

    async def completions(request: Request) -> Response:
        return await gw.inference(request, "completions")

    async def embeddings(request: Request) -> Response:
        return await gw.inference(request, "embeddings")

    async def responses(request: Request) -> Response:
        return await gw.inference(request, "responses")

    async def models(request: Request) -> Response:
        return gw.models(request)

    async def health(request: Request) -> Response:
        return JSONResponse(gw.health())

    async def metrics(request: Request) -> Response:
        gw.refresh()
        if config.gateway.protect_metrics:
            try:
                gw.auth.authorize_metrics(gw.auth.authenticate(request.headers.get("authorization")))
            except GatewayError as err:
                return error_response(err)
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = (
            f"Unknown path {request.url.path}"
            if exc.status_code == 404
            else f"{exc.detail} ({request.method})"
        )
        return error_response(GatewayError(exc.status_code, message, headers=dict(exc.headers or {})))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(GatewayError(500, f"Internal gateway error: {type(exc).__name__}"))

    async def openapi(request: Request) -> Response:
        """The OpenAI surface this gateway serves (the engine's request models)."""
        from fleet_base.openai_contract.openapi import openapi_document  # on first call: keeps startup light

        return JSONResponse(openapi_document("Fleet gateway", tokenize=False, bearer=True))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *(gw.batch.routes() if gw.batch is not None else []),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.gateway = gw
    return app
