"""The admin API application: `build_app(ctx)` wires routers, auth, the error shape,
a body-size limit, and a lifespan that starts NATS and the control loops."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.api import errors, metrics
from control_plane.api.auth import TokenCache, authenticate
from control_plane.api.protected import docs_urls, install_docs
from control_plane.api.routers import (
    adapters,
    batches,
    budgets,
    clusters,
    control_plane,
    cost,
    deployments,
    history,
    keys,
    model_cache,
    nodes,
    pipelines,
    rollouts,
    scheduled_jobs,
    usage,
)
from control_plane.batch_store import BatchStoreLink
from control_plane.console import install as install_console
from control_plane.context import ControlPlaneContext
from control_plane.ha.elector import Elector
from fleet_base.bounds import InputError, load_json

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


class PathGuard:
    """400 for a path with a control character (a NUL, say): no name has one, and databases
    differ on what they do with it (PostgreSQL refuses it, SQLite looks it up)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(ord(c) < 32 or ord(c) == 127 for c in scope.get("path", "")):
            await errors.error_response(400, "the request path contains a control character")(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for request bodies over `limit` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"request body over {self.limit} bytes"
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await errors.error_response(413, too_big)(scope, receive, send)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH") and b"json" in headers.get(b"content-type", b""):
            await self._checked_json(scope, receive, send, too_big)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # FastAPI passes HTTPExceptions from body reading through unchanged.
                    raise HTTPException(413, too_big)
            return message

        await self.app(scope, limited, send)

    async def _checked_json(self, scope: Scope, receive: Receive, send: Send, too_big: str) -> None:
        """Read the whole (bounded) body and refuse JSON nested too deep before a parser
        recurses into it; then hand the same bytes on."""
        parts: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # a disconnect: let the app see it
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await errors.error_response(413, too_big)(scope, receive, send)
                return
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(parts)
        if body.strip():
            try:
                load_json(body, finite=False)
            except InputError as err:
                if err.reason in ("depth", "utf8"):
                    await errors.error_response(400, str(err))(scope, receive, send)
                    return  # malformed JSON is left to the app's own (field-naming) message
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def start_loops(ctx: ControlPlaneContext) -> object | None:
    """`control_plane.loops.start_loops(ctx)` when that module exists (the control loops
    are optional for the API: without them it still records desired state). None only
    where the loops are absent; a failure to start them is raised."""
    try:
        module = importlib.import_module("control_plane.loops")
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("control_plane.loops"):
            log.info("control loops not available (%s); serving the API only", err)
            return None
        log.exception("control loops failed to import; serving the API only")
        return None
    except Exception:
        log.exception("control loops failed to import; serving the API only")
        return None
    starter = getattr(module, "start_loops", None)
    if starter is None:
        log.info("control_plane.loops has no start_loops; serving the API only")
        return None
    return await starter(ctx)  # a failure is the elector's to handle (it steps down and retries)


def build_app(ctx: ControlPlaneContext, *, run_loops: bool = True, public_url: str = "") -> FastAPI:
    """`run_loops`: stand for election (the leader runs the control loops); otherwise serve
    the API alone. `public_url`: this instance's address, as the members list shows it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        app.state.loops = None  # the running loops while this instance leads (GET /metrics reads them)
        app.state.elector = None
        if ctx.nats is not None:
            ctx.nats.start()
        if run_loops:
            app.state.elector = await Elector(
                ctx, start_loops, url=public_url, on_loops=lambda loops: setattr(app.state, "loops", loops)
            ).start()
        on_ready = getattr(app.state, "on_ready", None)
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            if app.state.elector is not None:
                try:
                    await app.state.elector.stop()
                except Exception:
                    log.exception("stopping the elector failed")
            if ctx.nats is not None:
                await ctx.nats.close()

    app = FastAPI(
        title="Fleet control plane",
        version="1",
        description="Admin API: deployments, versions, clusters, capacity pools, API keys, events, audit.",
        lifespan=lifespan,
        **docs_urls(ctx.settings.protect_docs),
    )
    if ctx.settings.protect_docs:
        install_docs(app)
    app.state.ctx = ctx
    app.state.token_cache = TokenCache()
    app.state.batch_link = BatchStoreLink(ctx.nats)  # batches and async requests, read from JetStream
    errors.install(app)
    app.add_middleware(BodyLimit)
    app.add_middleware(PathGuard)

    @app.get("/healthz", tags=["health"])
    async def healthz(request: Request) -> dict:
        nats = request.app.state.ctx.nats
        return {"status": "ok", "nats": bool(nats is not None and nats.is_connected)}

    auth = [Depends(authenticate)]
    # Prometheus text; FLEET_PROTECT_METRICS=1: a bearer token too
    app.include_router(metrics.router, dependencies=auth if ctx.settings.protect_metrics else [])

    routers = (
        deployments.router,
        adapters.router,
        clusters.router,
        keys.router,
        history.router,
        rollouts.router,
        usage.router,
        cost.router,
        model_cache.router,
        budgets.router,
        nodes.router,
        pipelines.router,
        batches.router,
        scheduled_jobs.router,
        control_plane.router,
    )
    for router in routers:
        app.include_router(router, dependencies=auth)
    install_console(app)  # /console: its own session login over the same tokens
    return app
