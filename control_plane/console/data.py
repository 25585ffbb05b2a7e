"""What each console page shows, gathered through the admin API's own view and route
functions (no query of theirs is repeated here), as plain dicts for the templates."""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from control_plane.api.auth import Principal
from control_plane.api.deps import Paging
from control_plane.api.routers import cost as cost_api
from control_plane.api.routers import history, rollouts, usage
from control_plane.api.schemas import ClusterOut
from control_plane.api.views import (
    clusters_out,
    deployment_status,
    deployment_summaries,
    key_out,
    pipeline_summaries,
)
from control_plane.console.worldmap import project
from control_plane.db.models import ApiKey, Cluster, Deployment, Node, Pipeline, Rollout
from control_plane.nodes.views import nodes_out, priced_pools

COLD_START = re.compile(r"after a ([0-9.]+) s cold start")
SCALED = re.compile(r"^(\d+) -> (\d+): (.*?)(?: (\{.*\}))?$", re.S)
QUOTA_WINDOWS = (("tokens_per_minute", "1m", "tokens"), ("requests_per_minute", "1m", "requests"),
                 ("tokens_per_day", "1d", "tokens"))  # fmt: skip


def _deployments(session: Session) -> list[Deployment]:
    return list(
        session.scalars(
            select(Deployment).options(selectinload(Deployment.versions)).order_by(Deployment.name)
        )
    )


def clusters(session: Session) -> list[ClusterOut]:
    rows = session.scalars(select(Cluster).options(selectinload(Cluster.pools)).order_by(Cluster.id))
    return clusters_out(session, list(rows))


def overview(session: Session) -> dict[str, Any]:
    cluster_views = clusters(session)
    deps = deployment_summaries(session, _deployments(session))
    spend = usage.hourly_cost(session, {d.name for d in deps})
    tiers: dict[str, dict[str, int]] = defaultdict(lambda: {"total": 0, "used": 0, "free": 0})
    pools = []
    for c in cluster_views:
        for p in c.pools:
            t = tiers[p.tier]
            t["total"] += p.total_gpus
            t["used"] += p.used_gpus
            t["free"] += p.free_gpus
            per_gpu = (p.hourly_price or 0.0) / max(1, p.gpus_per_node)
            pools.append({**p.model_dump(), "spend_per_hour": round(per_gpu * p.used_gpus, 4)})
    markers = []
    for c in cluster_views:
        x, y = project(c.lat, c.lon)
        markers.append({"id": c.id, "region": c.region, "status": c.status, "x": x, "y": y,
                        "replicas": c.replicas, "provider": c.provider})  # fmt: skip
    return {
        "clusters": cluster_views,
        "markers": markers,
        "deployments": [{**d.model_dump(), "spend_per_hour": round(spend.get(d.name, 0.0), 4)} for d in deps],
        "pools": pools,
        "tiers": dict(sorted(tiers.items())),
        "spend_per_hour": round(sum(spend.values()), 4),
        "healthy": sum(1 for c in cluster_views if c.status == "healthy"),
    }


EVENT_FILTERS = ("deployment", "cluster", "kind", "since")
AUDIT_FILTERS = ("resource_type", "resource_id", "action", "since")


def _page(
    listing: Callable[..., Any],
    names: tuple[str, ...],
    session: Session,
    who: Principal,
    limit: int,
    offset: int,
    filters: dict[str, Any],
) -> Any:
    """One page of an API listing called as a function: every filter is passed (None where
    unset), as the route's own defaults are FastAPI `Query` markers, not None."""
    return listing(session=session, who=who, page=Paging(limit, offset), **{n: filters.get(n) for n in names})


def events(
    session: Session, who: Principal, limit: int = 50, offset: int = 0, **filters: Any
) -> dict[str, Any]:
    return _page(history.list_events, EVENT_FILTERS, session, who, limit, offset, filters).model_dump()


def audit(
    session: Session, who: Principal, limit: int = 50, offset: int = 0, **filters: Any
) -> dict[str, Any]:
    page = _page(history.list_audit, AUDIT_FILTERS, session, who, limit, offset, filters)
    items = []
    for item in page.items:
        row = item.model_dump()
        row["changes"] = _changes(row.get("before"), row.get("after"))
        items.append(row)
    return {**page.model_dump(), "items": items}


def _changes(before: dict | None, after: dict | None) -> list[str]:
    """Top-level fields an audit record changed, e.g. `replicas: 2 -> 3`."""
    if before is None:
        return ["created"]
    if after is None:
        return ["deleted"]
    out = []
    for key in sorted(set(before) | set(after)):
        if key in ("updated_at", "placements", "versions"):
            continue
        old, new = before.get(key), after.get(key)
        if old != new:
            out.append(f"{key}: {_short(old)} -> {_short(new)}")
    return out[:12]


def _short(value: Any) -> str:
    text = json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def deployment(session: Session, who: Principal, name: str) -> dict[str, Any] | None:
    dep = session.scalar(
        select(Deployment).where(Deployment.name == name).options(selectinload(Deployment.versions))
    )
    if dep is None:
        return None
    status = deployment_status(session, dep)
    scaled = events(session, who, limit=30, deployment=name, kind="scaled")["items"]
    decisions = []
    for e in scaled:
        m = SCALED.match(e["message"])
        decisions.append({"at": e["at"], "from": m and int(m.group(1)), "to": m and int(m.group(2)),
                          "reason": m.group(3) if m else e["message"], "decision": _decision(m)})  # fmt: skip
    ready = events(session, who, limit=30, deployment=name, kind="replica_ready")["items"]
    cold = []
    for e in ready:
        m = COLD_START.search(e["message"])
        if m:
            cold.append(
                {"at": e["at"], "replica": e["replica_id"], "cluster": e["cluster"], "s": float(m[1])}
            )
    latest = session.scalar(
        select(Rollout).where(Rollout.deployment_id == dep.id).order_by(Rollout.id.desc())
    )
    return {
        "status": status,
        "decisions": decisions,
        "cold_starts": cold,
        "rollout": rollouts.rollout_out(latest, dep).model_dump() if latest is not None else None,
    }


def _decision(m: re.Match | None) -> dict[str, Any] | None:
    """The decision a `scaled` event carries as JSON (None: an older or foreign message)."""
    if m is None or not m.group(4):
        return None
    try:
        value = json.loads(m.group(4))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# What the page's autoscaler card shows of a decision's `predicted` record.
PLAN_FIELDS = ("cold_start_s", "scale_down_delay_s", "burst_need", "burst_held", "burst_hold_s",
               "burst_since_s", "burst_gap_s", "bursts", "burst_prompt_tokens_per_s", "requests_per_s",
               "prompt_tokens_per_s", "ttft_s", "attainment", "seasonal_cycle")  # fmt: skip


def autoscaler(loop: Any, name: str, decisions: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The autoscaler's plan for a deployment: the autoscale loop's last decision and its
    forecasts' errors where the loops run in this process (`loop`), else the last stored
    `scaled` decision (`decisions`, newest first; no errors then). None: no plan to show."""
    last = getattr(loop, "last", {}).get(name) if loop is not None else None
    if last is not None:
        predicted, desired, live = last.predicted, last.desired, True
    else:
        stored = next((d for d in decisions if d["decision"] and d["decision"].get("predicted")), None)
        if stored is None:
            return None
        predicted, desired, live = stored["decision"]["predicted"], stored["decision"].get("desired"), False
    if not predicted:
        return None
    errors = []
    checked = loop.errors.get(name) if loop is not None and live else None
    for signal, o in sorted((checked.last if checked is not None else {}).items()):
        errors.append({"signal": signal, "predicted": o.predicted, "observed": o.observed,
                       "error": o.error, "ratio": o.ratio, "mape": checked.mape(signal)})  # fmt: skip
    return {"live": live, "desired": desired, "errors": errors,
            **{k: predicted.get(k) for k in PLAN_FIELDS}}  # fmt: skip


def autoscale_points(
    loop: Any, session: Session, who: Principal, name: str, since: float
) -> tuple[list[tuple[float, int, dict]], list]:
    """The decisions `(at, desired, predicted)` since `since` and the forecasts checked
    since then: the loop's own where it runs here, else the stored `scaled` events'
    (decisions that changed the count only; no checked forecasts)."""
    if loop is not None and name in getattr(loop, "recent", {}):
        decided = [(at, d.desired, d.predicted) for at, d in list(loop.recent[name]) if at >= since]
        checked = loop.errors.get(name)
        outcomes = [o for o in list(checked.outcomes) if o.observed_at >= since] if checked else []
        return decided, outcomes
    start = datetime.fromtimestamp(since, tz=timezone.utc)
    rows = events(session, who, limit=200, deployment=name, kind="scaled", since=start)["items"]
    decided = []
    for e in reversed(rows):
        d = _decision(SCALED.match(e["message"]))
        if d is not None and isinstance(d.get("desired"), int):
            at = e["at"] if e["at"].tzinfo else e["at"].replace(tzinfo=timezone.utc)
            decided.append((at.timestamp(), d["desired"], d.get("predicted") or {}))
    return decided, []


def rollout(session: Session, who: Principal, name: str) -> dict[str, Any] | None:
    dep = session.scalar(
        select(Deployment).where(Deployment.name == name).options(selectinload(Deployment.versions))
    )
    if dep is None:
        return None
    rows = session.scalars(select(Rollout).where(Rollout.deployment_id == dep.id).order_by(Rollout.id.desc()))
    history_ = [rollouts.rollout_out(r, dep).model_dump() for r in rows]
    current = next((r for r in history_ if r["active"]), history_[0] if history_ else None)
    timeline = []
    if current is not None:
        since = current["created_at"]
        for e in events(session, who, limit=100, deployment=name)["items"]:
            if e["kind"].startswith("rollout") and e["at"] >= since:
                timeline.append(e)
    return {"name": name, "current": current, "history": history_[:10], "timeline": timeline}


def keys_and_usage(session: Session, who: Principal, since: str = "1h") -> dict[str, Any]:
    keys = [key_out(r) for r in session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id))]
    report = usage.get_usage(session=session, who=who, key=None, deployment=None, since=since)
    windows = {w: usage.get_usage(session=session, who=who, key=None, deployment=None, since=w)
               for w in ("1m", "1d")}  # fmt: skip
    used: dict[tuple[str, str], dict[str, int]] = {}
    for window, rep in windows.items():
        for item in rep.items:
            u = used.setdefault((item.key_id, window), {"tokens": 0, "requests": 0})
            u["tokens"] += item.total_tokens
            u["requests"] += item.requests
    rows = []
    for k in keys:
        headroom = []
        for field, window, what in QUOTA_WINDOWS:
            limit = (k.quotas or {}).get(field)
            if not limit:
                continue
            spent = used.get((k.key_id, window), {}).get(what, 0)
            headroom.append({"limit": field, "max": limit, "used": spent, "left": max(0, limit - spent)})
        rows.append({**k.model_dump(), "headroom": headroom})
    return {"keys": rows, "usage": report.model_dump(), "since": since}


COST_WINDOWS = ("1h", "6h", "1d", "7d", "30d")


def cost(session: Session, who: Principal, since: str = "7d") -> dict[str, Any]:
    """The cost report by deployment and by team over the same window (the API's route)."""
    reports = {by: cost_api.get_cost(session=session, who=who, since=since, by=by).model_dump()
               for by in ("deployment", "team")}  # fmt: skip
    return {"since": since, "windows": COST_WINDOWS, **reports}


def nodes(session: Session) -> dict[str, Any]:
    """Every node with its record, and each pool's node faults and reliability premium."""
    rows = session.scalars(select(Node).order_by(Node.cluster, Node.node)).all()
    pools = [
        {**p.model_dump(), "faults": n, "premium": p.reliability_premium} for p, n in priced_pools(session)
    ]
    return {"nodes": [n.model_dump() for n in nodes_out(session, rows)], "pools": pools}


def pipelines(session: Session) -> dict[str, Any]:
    """Every pipeline with its steps and the clusters where every step is ready."""
    rows = list(session.scalars(select(Pipeline).order_by(Pipeline.name)))
    return {"pipelines": [p.model_dump() for p in pipeline_summaries(session, rows)]}


def pipeline(session: Session, name: str) -> dict[str, Any] | None:
    """The pipeline's readiness per cluster (`GET /v1/pipelines/{name}`'s view) and each
    step's deployment as the deployments list shows it (None: the row is gone)."""
    row = session.scalar(select(Pipeline).where(Pipeline.name == name))
    if row is None:
        return None
    status = pipeline_summaries(session, [row])[0].model_dump()
    deps = session.scalars(
        select(Deployment)
        .where(Deployment.name.in_([s["deployment"] for s in status["steps"]]))
        .options(selectinload(Deployment.versions))
    )
    by_name = {d.name: d.model_dump() for d in deployment_summaries(session, list(deps))}
    steps = [{**s, "d": by_name.get(s["deployment"])} for s in status["steps"]]
    return {"status": status, "steps": steps}


def now() -> float:
    return time.time()


def iso(value: datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _when(value: Any) -> datetime | None:
    if isinstance(value, datetime) or value is None:
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def control_plane(view: dict[str, Any]) -> dict[str, Any]:
    """The card of `GET /v1/control-plane`'s answer: members leader first, times as datetimes."""
    members = sorted(view.get("members") or [], key=lambda m: (not m.get("is_leader"), str(m.get("id"))))
    return {
        "leader": view.get("leader"),
        "epoch": view.get("epoch", 0),
        "is_leader": bool(view.get("is_leader")),
        "members": [
            {**m, "last_seen": _when(m.get("last_seen")), "started_at": _when(m.get("started_at"))}
            for m in members
        ],
    }


def _epoch(value: int | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, timezone.utc)


def batches(batch_rows: list[dict[str, Any]], async_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The batches page: each batch with its progress (lines with a result, of the total)
    and times as datetimes; async requests with theirs."""
    out = []
    for b in batch_rows:
        counts = b.get("request_counts") or {}
        total, finished = counts.get("total", 0), counts.get("completed", 0) + counts.get("failed", 0)
        out.append(
            {
                **b,
                "finished": finished,
                "total": total,
                "percent": round(100 * finished / total) if total else 0,
                "created": _epoch(b.get("created_at")),
                "expires": _epoch(b.get("expires_at")),
            }
        )
    requests = [
        {**r, "created": _epoch(r.get("created_at")), "finished": _epoch(r.get("finished_at"))}
        for r in async_rows
    ]
    return {"batches": out, "requests": requests}
