"""Deployments and their versions. Creating makes version 1; an update that changes the
spec makes version N+1 and points `current_version` at it; scaling changes only the
desired replica count, within the current version's min..max."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from control_plane.api import specs
from control_plane.api.adapters import apply_adapters
from control_plane.api.audit import audit, event
from control_plane.api.deps import PagingDep, PrincipalDep, SessionDep, insert, kick
from control_plane.api.errors import conflict, invalid, not_found
from control_plane.api.schemas import (
    DeploymentCreate,
    DeploymentStatus,
    DeploymentSummary,
    DeploymentUpdate,
    Page,
    ScaleRequest,
    VersionOut,
)
from control_plane.api.views import deployment_status, deployment_summaries, version_out
from control_plane.db.models import CapacityPool, Deployment, DeploymentVersion, ReplicaAssignment, utcnow
from control_plane.pipelines import pipelines_using
from control_plane.rollouts.store import active_for

router = APIRouter(prefix="/v1/deployments", tags=["deployments"])
VersionNumber = Annotated[int, Path(ge=1, le=2**31 - 1)]


def _load(session: Session, name: str, lock: bool = False) -> Deployment:
    """The deployment; `lock` holds its row until commit (PostgreSQL), so two concurrent
    changes apply one after the other (SQLite serializes writers itself; a lost race is a 409)."""
    query = select(Deployment).where(Deployment.name == name)
    if lock:
        query = query.with_for_update()
    dep = session.scalar(query.options(selectinload(Deployment.versions)))
    if dep is None:
        raise not_found("deployment", name)
    return dep


def check_node_fit(session: Session, spec: dict) -> None:
    """`specs.check_node_fit` against every registered pool."""
    specs.check_node_fit(spec, session.scalars(select(CapacityPool)).all())


@router.post("", status_code=201, response_model=DeploymentStatus)
def create_deployment(body: DeploymentCreate, request: Request, session: SessionDep, who: PrincipalDep):
    spec, replicas = specs.new_spec(body)
    check_node_fit(session, spec)
    if session.scalar(select(Deployment.id).where(Deployment.name == body.name)) is not None:
        raise conflict(f"deployment {body.name!r} already exists (update it with PATCH)", "name")
    dep = Deployment(name=body.name, replicas=replicas, current_version=1)
    specs.apply_policy(dep, body)
    specs.apply_residency(dep, body)
    apply_adapters(dep, body)
    dep.versions.append(DeploymentVersion(version=1, **spec))
    insert(session, dep, conflict(f"deployment {body.name!r} already exists", "name"))
    status = deployment_status(session, dep)
    audit(session, who, "deployment.create", "deployment", dep.name, None, status)
    event(
        session,
        "deployment_created",
        f"{dep.name}: version 1 of {spec['model']}, {replicas} replica(s)",
        deployment=dep.name,
    )
    session.commit()
    kick(request)
    return status


@router.get("", response_model=Page[DeploymentSummary])
def list_deployments(
    session: SessionDep,
    who: PrincipalDep,
    page: PagingDep,
    model: str | None = Query(None, max_length=512, description="only deployments of this model"),
    name_prefix: str | None = Query(None, max_length=63, description="only names starting with this"),
):
    query = select(Deployment).options(selectinload(Deployment.versions)).order_by(Deployment.name)
    if model is not None:
        query = query.join(
            DeploymentVersion,
            (DeploymentVersion.deployment_id == Deployment.id)
            & (DeploymentVersion.version == Deployment.current_version),
        ).where(DeploymentVersion.model == model)
    if name_prefix:
        query = query.where(Deployment.name.startswith(name_prefix, autoescape=True))
    rows, total = page.apply(session, query)
    return Page(items=deployment_summaries(session, rows), total=total, limit=page.limit, offset=page.offset)


@router.get("/{name}", response_model=DeploymentStatus)
def get_deployment(name: str, session: SessionDep, who: PrincipalDep):
    return deployment_status(session, _load(session, name))


@router.patch("/{name}", response_model=DeploymentStatus)
def update_deployment(
    name: str, body: DeploymentUpdate, request: Request, session: SessionDep, who: PrincipalDep
):
    dep = _load(session, name, lock=True)
    before = deployment_status(session, dep)
    current = dep.version_row()
    current_spec = specs.version_fields(current)
    spec, replicas = specs.merged_spec(current_spec, dep.replicas, body, specs.adapters_after(dep, body))
    changes = []
    if spec != current_spec:
        check_node_fit(session, spec)
        rollout = active_for(session, dep.id)
        if rollout is not None:
            raise conflict(
                f"{name} is rolling out version {rollout.canary_version}; promote or abort it before "
                "changing the spec (fleetctl rollout promote|abort)",
                "deployment",
            )
        version = max(v.version for v in dep.versions) + 1
        dep.versions.append(DeploymentVersion(version=version, **spec))
        dep.current_version = version
        changed = sorted(k for k in spec if spec[k] != current_spec[k])
        changes.append(f"version {version} ({', '.join(changed)} changed)")
    if replicas != dep.replicas:
        changes.append(f"replicas {dep.replicas} -> {replicas}")
        dep.replicas = replicas
    changes += specs.apply_policy(dep, body)
    changes += specs.apply_residency(dep, body)
    changes += apply_adapters(dep, body)
    if not changes:
        return before
    dep.updated_at = utcnow()
    session.flush()
    after = deployment_status(session, dep)
    audit(session, who, "deployment.update", "deployment", dep.name, before, after)
    event(session, "deployment_updated", f"{dep.name}: {'; '.join(changes)}", deployment=dep.name)
    session.commit()
    kick(request)
    return after


@router.post("/{name}/scale", response_model=DeploymentStatus)
def scale_deployment(name: str, body: ScaleRequest, request: Request, session: SessionDep, who: PrincipalDep):
    dep = _load(session, name)
    current = dep.version_row()
    if not current.min_replicas <= body.replicas <= current.max_replicas:
        raise invalid(
            "replicas",
            f"{body.replicas} is outside min_replicas..max_replicas "
            f"({current.min_replicas}..{current.max_replicas}) of version {current.version}; "
            "change the bounds with an update (fleetctl deploy --min-replicas/--max-replicas)",
        )
    before = deployment_status(session, dep)
    policy = specs.apply_policy(dep, body)
    if body.replicas == dep.replicas and not policy:
        return before
    old = dep.replicas
    dep.replicas = body.replicas
    dep.updated_at = utcnow()
    session.flush()
    after = deployment_status(session, dep)
    audit(
        session,
        who,
        "deployment.scale",
        "deployment",
        dep.name,
        {"replicas": old},
        {"replicas": body.replicas, **body.model_dump(include=set(specs.POLICY_FIELDS), exclude_none=True)},
    )
    what = [f"replicas {old} -> {body.replicas}"] if old != body.replicas else []
    event(
        session,
        "scaled",
        f"{dep.name}: {'; '.join(what + policy)} (by {who.actor})",
        deployment=dep.name,
    )
    session.commit()
    kick(request)
    return after


@router.delete("/{name}", response_model=DeploymentStatus)
def delete_deployment(name: str, request: Request, session: SessionDep, who: PrincipalDep):
    """A step of a pipeline is refused (409): removing it would split the pipeline silently."""
    dep = _load(session, name, lock=True)
    if using := pipelines_using(session, name):
        raise conflict(
            f"deployment {name!r} is a step of pipeline(s) {', '.join(using)}: "
            "delete those first (fleetctl pipeline rm)"
        )
    before = deployment_status(session, dep)
    session.delete(dep)
    audit(session, who, "deployment.delete", "deployment", name, before, None)
    event(
        session,
        "deployment_deleted",
        f"{name}: deleted ({len(before.placements)} replica(s) to stop)",
        deployment=name,
    )
    session.commit()
    kick(request)
    return before


@router.get("/{name}/versions", response_model=Page[VersionOut])
def list_versions(name: str, session: SessionDep, who: PrincipalDep):
    status = deployment_status(session, _load(session, name))
    return Page(items=status.versions, total=len(status.versions), limit=len(status.versions), offset=0)


@router.get("/{name}/versions/{version}", response_model=VersionOut)
def get_version(name: str, version: VersionNumber, session: SessionDep, who: PrincipalDep):
    status = deployment_status(session, _load(session, name))
    for row in status.versions:
        if row.version == version:
            return row
    raise not_found(f"version of {name}", version)


@router.delete("/{name}/versions/{version}", response_model=VersionOut)
def delete_version(
    name: str, version: VersionNumber, request: Request, session: SessionDep, who: PrincipalDep
):
    """Forget an old version. The current one, or one that still has replicas, is in use: 409."""
    dep = _load(session, name)
    row = dep.version_row(version)
    if row is None:
        raise not_found(f"version of {name}", version)
    if version == dep.current_version:
        raise conflict(f"version {version} is the current version of {name}", "version")
    running = session.scalar(
        select(ReplicaAssignment.replica_id).where(
            ReplicaAssignment.deployment_id == dep.id, ReplicaAssignment.version == version
        )
    )
    if running is not None:
        raise conflict(f"version {version} of {name} still has replicas (e.g. {running})", "version")
    rollout = active_for(session, dep.id)
    if rollout is not None and version == rollout.canary_version:
        raise conflict(f"version {version} of {name} is being rolled out", "version")
    out = version_out(row, dep.current_version)
    dep.versions.remove(row)
    audit(session, who, "version.delete", "deployment_version", f"{name}/{version}", out, None)
    session.commit()
    kick(request)
    return out
