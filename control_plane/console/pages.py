"""The console's pages (GET only): each page renders its live part from a fragment
template that htmx re-fetches every few seconds (`.../panel`), and its charts read
`.../series.json`. Every route needs a console session (`web.require`)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from control_plane.api.deps import Paging
from control_plane.api.errors import ApiError
from control_plane.api.routers import batches as batches_api
from control_plane.api.routers import control_plane as control_plane_api
from control_plane.api.routers import cost as cost_api
from control_plane.console import data, series
from control_plane.console.session import ConsoleSession
from control_plane.console.web import render, require, secure
from control_plane.console.worldmap import land_svg

router = APIRouter(prefix="/console", include_in_schema=False, dependencies=[Depends(require)])

GUARD_WINDOW_S = 30.0  # the rollout chart starts this long before the rollout
DEPLOYMENT_WINDOW_S = 300.0
WINDOW_EVENTS = ("rollout_started", "rollout_step", "rollout_resumed")


def _db(request: Request):
    return request.app.state.ctx.sessions()


def _missing(request: Request, what: str):
    return render(request, "message.html", 404, title="Not found", message=f"{what} not found.")


@router.get("")
def root():
    return secure(RedirectResponse("/console/", status_code=307))


@router.get("/")
def overview(request: Request):
    with _db(request) as db:
        return render(request, "overview.html", page="overview", o=data.overview(db))


@router.get("/land.svg")
def land():
    response = secure(Response(land_svg(), media_type="image/svg+xml"))
    response.headers["Cache-Control"] = "private, max-age=86400"
    return response


@router.get("/panel/overview")
def overview_panel(request: Request):
    with _db(request) as db:
        return render(request, "_overview.html", o=data.overview(db))


async def _control_plane_view(request: Request) -> dict[str, Any]:
    """`GET /v1/control-plane`'s answer from this instance, through the route's own function."""
    answer = await control_plane_api.control_plane_members(request)
    return answer.model_dump(mode="json")


@router.get("/panel/control-plane")
async def control_plane_panel(request: Request):
    return render(request, "_control_plane.html", cp=data.control_plane(await _control_plane_view(request)))


def _autoscale_loop(request: Request) -> Any:
    """The autoscale loop where the loops run in this process (None: they run elsewhere)."""
    return getattr(getattr(request.app.state, "loops", None), "autoscale", None)


def _deployment_view(
    path: str,
    stem: str,
    load: Callable[..., dict[str, Any] | None],
    key: str,
    enrich: Callable[[Request, str, dict[str, Any]], None] | None = None,
) -> None:
    """Route a deployment's page `path` ("{stem}.html") and its live fragment `path/panel`
    ("_{stem}.html") over the view `load` builds (and `enrich` adds to, from the request's
    app); an unknown deployment is a 404 page."""

    def view(deployment: str, request: Request, who: ConsoleSession, fragment: bool):
        with _db(request) as db:
            found = load(db, who.principal, deployment)
        if found is not None and enrich is not None:
            enrich(request, deployment, found)
        if found is None:
            return _missing(request, f"Deployment {deployment!r}")
        if fragment:
            return render(request, f"_{stem}.html", name=deployment, **{key: found})
        return render(request, f"{stem}.html", page="deployments", name=deployment, **{key: found})

    @router.get(path, name=stem)
    def page(name: str, request: Request, who: ConsoleSession = Depends(require)):
        return view(name, request, who, fragment=False)

    @router.get(f"{path}/panel", name=f"{stem}_panel")
    def panel(name: str, request: Request, who: ConsoleSession = Depends(require)):
        return view(name, request, who, fragment=True)


def _with_autoscaler(request: Request, name: str, found: dict[str, Any]) -> None:
    found["autoscaler"] = data.autoscaler(_autoscale_loop(request), name, found["decisions"])


_deployment_view("/deployments/{name}", "deployment", data.deployment, "d", _with_autoscaler)


@router.get("/deployments/{name}/series.json")
def deployment_series(
    name: str, request: Request, window_s: float = Query(DEPLOYMENT_WINDOW_S, ge=10, le=86_400)
):
    until = data.now()
    since = until - window_s
    with _db(request) as db:
        rows = series.usage_rows(db, name, since)
    return secure(JSONResponse(series.deployment_series(rows, since, until)))


@router.get("/deployments/{name}/autoscale.json")
def autoscale_series(
    name: str,
    request: Request,
    who: ConsoleSession = Depends(require),
    window_s: float = Query(DEPLOYMENT_WINDOW_S, ge=10, le=86_400),
):
    until = data.now()
    since = until - window_s
    with _db(request) as db:
        decided, checked = data.autoscale_points(_autoscale_loop(request), db, who.principal, name, since)
    return secure(JSONResponse(series.autoscale_series(decided, checked, since, until)))


_deployment_view("/deployments/{name}/rollout", "rollout", data.rollout, "r")


@router.get("/deployments/{name}/rollout/series.json")
def rollout_series(name: str, request: Request, who: ConsoleSession = Depends(require)):
    with _db(request) as db:
        r = data.rollout(db, who.principal, name)
        current = r and r["current"]
        if not current:
            return secure(JSONResponse({"errors": None, "ttft": None}))
        start = current["created_at"].timestamp() - GUARD_WINDOW_S
        end = current["finished_at"].timestamp() + 5 if current["finished_at"] else data.now()
        windows = getattr(
            getattr(getattr(request.app.state, "loops", None), "rollouts", None), "windows", None
        )
        if windows is not None:
            samples = windows.samples(name, start)
        else:
            samples = series.samples_of(series.usage_rows(db, name, start))
    params = current["params"]
    # a step's window opens with its event; a finished rollout's line stays where it ended
    windows = [e["at"].timestamp() for e in r["timeline"] if e["kind"] in WINDOW_EVENTS]
    body = series.guard_series(
        [s for s in samples if s.at <= end],
        current["baseline_version"],
        current["canary_version"],
        start,
        end,
        float(params["max_error_rate"]),
        float(params["max_ttft_p90_ratio"]),
        windows,
    )
    return secure(JSONResponse(body))


@router.get("/keys")
def keys(request: Request, who: ConsoleSession = Depends(require), since: str = Query("1h", max_length=64)):
    with _db(request) as db:
        k = data.keys_and_usage(db, who.principal, since)
    return render(request, "keys.html", page="keys", k=k)


@router.get("/cost")
def cost(request: Request, who: ConsoleSession = Depends(require), since: str = Query("7d", max_length=64)):
    with _db(request) as db:
        try:
            c = data.cost(db, who.principal, since)
        except ApiError as err:
            return render(request, "message.html", err.status, title="Not shown", message=err.message)
    return render(request, "cost.html", page="cost", c=c)


@router.get("/cost/series.json")
def cost_series(request: Request, since: str = Query("7d", max_length=64)):
    try:
        start, until = cost_api.window(since)
    except ApiError as err:
        return secure(JSONResponse({"error": err.message}, status_code=err.status))
    with _db(request) as db:
        held = series.held_intervals(db, start, until)
    return secure(JSONResponse(series.hourly_series(held, start, until)))


@router.get("/nodes")
def nodes(request: Request):
    with _db(request) as db:
        v = data.nodes(db)
    return render(request, "nodes.html", page="nodes", v=v)


@router.get("/pipelines")
def pipelines(request: Request):
    with _db(request) as db:
        v = data.pipelines(db)
    return render(request, "pipelines.html", page="pipelines", v=v)


BATCH_ROWS = 50


async def _batches_view(request: Request, who: ConsoleSession) -> tuple[dict[str, Any], str]:
    """The newest batches and async requests through the admin API's own route functions,
    and why they could not be read (NATS unreachable), if so."""
    try:
        shown = Paging(BATCH_ROWS, 0)
        found = await batches_api.list_batches(request, who.principal, shown)
        requests = await batches_api.list_async_requests(request, who.principal, shown)
    except ApiError as err:
        return data.batches([], []), err.message
    dump = (
        [b.model_dump(mode="json") for b in found.items],
        [r.model_dump(mode="json") for r in requests.items],
    )
    return {**data.batches(*dump), "total": found.total, "requests_total": requests.total}, ""


@router.get("/batches")
async def batches(request: Request, who: ConsoleSession = Depends(require)):
    v, down = await _batches_view(request, who)
    return render(request, "batches.html", page="batches", v=v, down=down)


@router.get("/batches/panel")
async def batches_panel(request: Request, who: ConsoleSession = Depends(require)):
    v, down = await _batches_view(request, who)
    return render(request, "_batches.html", v=v, down=down)


def _pipeline(request: Request, name: str, fragment: bool):
    with _db(request) as db:
        found = data.pipeline(db, name)
    if found is None:
        return _missing(request, f"Pipeline {name!r}")
    if fragment:
        return render(request, "_pipeline.html", name=name, p=found)
    return render(request, "pipeline.html", page="pipelines", name=name, p=found)


@router.get("/pipelines/{name}")
def pipeline(name: str, request: Request):
    return _pipeline(request, name, fragment=False)


@router.get("/pipelines/{name}/panel")
def pipeline_panel(name: str, request: Request):
    return _pipeline(request, name, fragment=True)


def _filters(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v not in (None, "")}


@router.get("/events")
def events(
    request: Request,
    who: ConsoleSession = Depends(require),
    deployment: str | None = Query(None, max_length=63),
    cluster: str | None = Query(None, max_length=63),
    kind: str | None = Query(None, max_length=32),
    since: datetime | None = Query(None),
    offset: int = Query(0, ge=0, le=10**9),
    fragment: bool = Query(False),
):
    filters = _filters(deployment=deployment, cluster=cluster, kind=kind, since=since)
    with _db(request) as db:
        page = data.events(db, who.principal, 50, offset, **filters)
    template = "_events.html" if fragment else "events.html"
    return render(request, template, page="events", p=page, filters=filters)


@router.get("/audit")
def audit(
    request: Request,
    who: ConsoleSession = Depends(require),
    resource_type: str | None = Query(None, max_length=32),
    resource_id: str | None = Query(None, max_length=128),
    action: str | None = Query(None, max_length=64),
    since: datetime | None = Query(None),
    offset: int = Query(0, ge=0, le=10**9),
    fragment: bool = Query(False),
):
    filters = _filters(resource_type=resource_type, resource_id=resource_id, action=action, since=since)
    with _db(request) as db:
        page = data.audit(db, who.principal, 50, offset, **filters)
    template = "_audit.html" if fragment else "audit.html"
    return render(request, template, page="audit", p=page, filters=filters)
