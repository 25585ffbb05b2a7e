"""`fleetctl status` without a deployment: the control plane's instances, which one leads and
its epoch (`GET /v1/control-plane`), and the leader's scheduled jobs when it lists them (in
that answer, else `GET /v1/control-plane/jobs`)."""

from __future__ import annotations

from typing import Any

from control_plane.client import ApiError, FleetClient
from control_plane.commands.output import OutputFormat, console, emit_json, fail, show

MEMBER_COLUMNS = {
    "id": "id",
    "url": "url",
    "leader": "role",
    "last seen": "last_seen",
    "started": "started_at",
}
JOB_COLUMNS = {
    "job": "id",
    "trigger": "trigger",
    "next run": "next_run_at",
    "last run": "last_run_at",
    "outcome": "last_outcome",
}


def fetch(client: FleetClient) -> dict[str, Any]:
    """The members view, with `jobs` filled in from the jobs route when it has none."""
    view = client.get("/v1/control-plane")
    if "jobs" not in view:
        try:
            view["jobs"] = client.get("/v1/control-plane/jobs").get("jobs", [])
        except ApiError as err:
            if err.status not in (404, 405):
                raise
    view["answered_by"] = client.url
    return view


def render(view: dict[str, Any], output: OutputFormat) -> None:
    if output == OutputFormat.json:
        emit_json(view)
        return
    members = sorted(view.get("members") or [], key=lambda m: (not m.get("is_leader"), str(m.get("id"))))
    rows = [{**m, "role": "leader" if m.get("is_leader") else "follower"} for m in members]
    leader = view.get("leader")
    title = f"control plane: leader {leader or 'none'}, epoch {view.get('epoch', 0)}"
    if rows:
        show(rows, output, MEMBER_COLUMNS, title=title)
    else:
        console.print(f"{title}; no members recorded", highlight=False)
    if leader is None:
        console.print(
            "[yellow]no leader: nothing reconciles, scales or rolls out until one is elected[/yellow]"
        )
    answered = view.get("answered_by")
    if answered:
        role = "the leader" if view.get("is_leader") else "a follower"
        console.print(f"answered by {answered} ({role})", highlight=False)
    if view.get("jobs"):
        show(view["jobs"], output, JOB_COLUMNS, title="scheduled jobs (run by the leader)")


def control_plane_status(output: OutputFormat) -> None:
    try:
        with FleetClient() as client:
            view = fetch(client)
    except ApiError as err:
        if err.status == 404:
            fail("this control plane does not report its instances (GET /v1/control-plane: 404)")
        fail(str(err))
    render(view, output)
