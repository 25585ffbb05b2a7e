"""One reconcile pass against the database: read the fleet, place, write the changed
assignments and their events in one transaction, and return what NATS should hold."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

from pydantic import BaseModel, ConfigDict
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.cost import ledger
from control_plane.db.models import Deployment, Event, ReplicaAssignment, utcnow
from control_plane.fleet_model.demand_regions import read_demand_regions, with_demand_regions
from control_plane.fleet_model.plan import (
    build_desired,
    build_routes,
    next_assignments,
    placement_inputs,
    removal_context,
)
from control_plane.fleet_model.snapshot import FleetSnapshot, read_snapshot
from control_plane.fleet_model.standby import standby_demands
from control_plane.pipelines import load_pipelines
from control_plane.placement import PlacementResult, Placer, SolvedPlan, SolveInfo, Unplaced, pipeline
from control_plane.placement.hold import UNREACHABLE
from fleet_base.protocol import BUCKET_DESIRED, BUCKET_ROUTES, Message, ReplicaState

log = logging.getLogger(__name__)


class ReconcileOutcome(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    result: PlacementResult
    wanted: dict[str, dict[str, Message]]  # bucket -> key -> message
    info: SolveInfo | None = None  # how the placer found the plan
    solved: SolvedPlan | None = None  # pass back as `previous` next time

    @property
    def changed(self) -> bool:
        return self.result.changed


def reconcile_once(
    sessions: sessionmaker[Session],
    placer: Placer,
    nodes: dict[str, int],
    reported: dict[tuple[str, int], Unplaced],
    previous: SolvedPlan | None = None,
    hold_s: float = 300.0,
) -> ReconcileOutcome:
    """Synchronous (run it in a thread). `nodes` (replica id -> node index) and
    `reported` (shortfalls already announced as events) are the loop's memory and are
    updated in place; `previous` is the last outcome's `solved` (the warm start); a silent
    cluster's unreachable replicas are held for `hold_s` after its last heartbeat."""
    with sessions() as session:
        snap = read_snapshot(session)
        demands, pools, current = placement_inputs(snap, nodes)
        demands = with_demand_regions(demands, read_demand_regions(session, snap))  # nearer to clients
        pipelines = load_pipelines(session)  # their steps are placed together
        inputs = pipeline.PlacementInputs(
            demands=tuple(demands),
            pools=tuple(pools),
            current=tuple(current),
            standby=tuple(standby_demands(snap)),
            pipelines=tuple(pipelines),
            ready=frozenset(a.replica_id for a in snap.assignments if a.state == ReplicaState.ready.value),
            unreachable=_still_held(snap, hold_s),
        )
        outcome = pipeline.run(inputs, placer, previous=previous, context=removal_context(snap))
        result = outcome.result
        shortfalls = {(u.deployment, u.version): u for u in result.unplaced}
        ledger_changed = ledger.sync(session, snap.assignments)  # replicas that went another way
        if result.changed or shortfalls != reported:
            _write(session, snap, result, reported, outcome.reasons)
            session.commit()
            reported.clear()
            reported.update(shortfalls)
        elif ledger_changed:
            session.commit()
        nodes.clear()
        nodes.update({a.replica_id: a.node for a in result.assignments if a.node is not None})
        assignments = next_assignments(snap, result)
        wanted: dict[str, dict[str, Message]] = {
            BUCKET_DESIRED: dict(build_desired(snap, assignments)),
            BUCKET_ROUTES: dict(build_routes(snap, assignments, pipelines)),
        }
        return ReconcileOutcome(result=result, wanted=wanted, info=outcome.info, solved=outcome.solved)


def _still_held(snap: FleetSnapshot, hold_s: float) -> frozenset[str]:
    """Unreachable replicas whose cluster was last heard less than `hold_s` ago."""
    since = utcnow() - timedelta(seconds=hold_s)
    heard = {c.id for c in snap.clusters if c.last_heartbeat_at is not None and c.last_heartbeat_at > since}
    return frozenset(a.replica_id for a in snap.assignments if a.state == UNREACHABLE and a.cluster in heard)


def _write(
    session: Session,
    snap: FleetSnapshot,
    result: PlacementResult,
    reported: Mapping[tuple[str, int], Unplaced],
    reasons: Mapping[str, str],
) -> None:
    now = utcnow()
    if result.removed:
        rows = {a.replica_id: a for a in snap.assignments}
        preempted = {p.replica_id for p in result.preempted}
        session.execute(delete(ReplicaAssignment).where(ReplicaAssignment.replica_id.in_(result.removed)))
        for rid in result.removed:
            row = rows.get(rid)
            failed = row is not None and row.state == ReplicaState.failed.value
            reason = ledger.PREEMPTED if rid in preempted else ledger.FAILED if failed else ledger.REMOVED
            ledger.end(session, [rid], reason, now)
        for rid in result.removed:
            row = rows.get(rid)
            session.add(
                Event(
                    kind="preempted" if rid in preempted else "removed",
                    cluster=row.cluster if row else None,
                    deployment=row.deployment if row else None,
                    replica_id=rid,
                    message=f"{rid} removed: {reasons.get(rid, 'no longer wanted')}",
                )
            )
    if result.added:
        ledger.start(session, result.added, now)
        ids = dict(
            session.execute(
                select(Deployment.name, Deployment.id).where(
                    Deployment.name.in_({a.deployment for a in result.added})
                )
            ).all()
        )
        for a in result.added:
            session.add(
                ReplicaAssignment(
                    replica_id=a.replica_id,
                    deployment_id=ids[a.deployment],
                    version=a.version,
                    cluster_id=a.cluster,
                    pool_name=a.pool,
                    gpus=a.gpus,
                    state="pending",
                )
            )
            session.add(
                Event(
                    kind="placed",
                    cluster=a.cluster,
                    deployment=a.deployment,
                    replica_id=a.replica_id,
                    message=f"{a.replica_id} (v{a.version}, {a.gpus} GPU) placed on {a.cluster}/{a.pool}",
                )
            )
    for u in result.unplaced:
        if reported.get((u.deployment, u.version)) != u:
            session.add(
                Event(
                    kind="placement_short",
                    deployment=u.deployment,
                    message=f"{u.deployment} v{u.version}: {u.missing} replica(s) unplaced: {u.reason}"
                    if u.missing
                    else f"{u.deployment} v{u.version}: {u.reason}",
                )
            )
