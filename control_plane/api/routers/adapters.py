"""`/v1/deployments/{name}/adapters`: list, add and remove a deployment's LoRA adapters
(`fleetctl lora ls|add|rm`). A change reaches agents with the next desired state."""

from __future__ import annotations

from fastapi import APIRouter, Path, Request
from sqlalchemy.orm import Session

from control_plane.api import specs
from control_plane.api.adapters import adapter_record
from control_plane.api.audit import audit, event
from control_plane.api.auth import Principal
from control_plane.api.deps import PrincipalDep, SessionDep, kick
from control_plane.api.errors import conflict, not_found
from control_plane.api.routers.deployments import _load
from control_plane.api.schemas import AdapterIn
from control_plane.db.models import utcnow
from control_plane.rollouts.store import active_for
from fleet_base.domain import AdapterName
from fleet_base.protocol import DEFAULT_MAX_ADAPTERS

router = APIRouter(prefix="/v1/deployments", tags=["adapters"])


def _view(dep) -> dict:
    return {
        "deployment": dep.name,
        "max_adapters": dep.max_adapters or 0,
        "adapters": list(dep.adapters or []),
    }


def _commit(
    request: Request, session: Session, who: Principal, dep, before: dict, verb: str, note: str
) -> dict:
    """Store a changed adapter set with its audit record and event, and wake the loops."""
    dep.updated_at = utcnow()
    session.flush()
    after = _view(dep)
    audit(session, who, f"deployment.adapter_{verb}", "deployment", dep.name, before, after)
    event(session, "deployment_updated", f"{dep.name}: {note}", deployment=dep.name)
    session.commit()
    kick(request)
    return after


def _running_versions(session: Session, dep) -> list:
    """The versions replicas run now or soon: the current one and an active rollout's canary."""
    rollout = active_for(session, dep.id)
    wanted = {dep.current_version} | ({rollout.canary_version} if rollout is not None else set())
    return [v for v in dep.versions if v.version in wanted]


@router.get("/{name}/adapters")
def list_adapters(name: str, session: SessionDep, who: PrincipalDep) -> dict:
    return _view(_load(session, name))


@router.post("/{name}/adapters", status_code=201)
def add_adapter(name: str, body: AdapterIn, request: Request, session: SessionDep, who: PrincipalDep) -> dict:
    dep = _load(session, name, lock=True)
    before = _view(dep)
    if any(a["name"] == body.name for a in dep.adapters or []):
        raise conflict(f"deployment {name!r} already has an adapter named {body.name!r}", "name")
    if body.name == name:
        raise conflict(f"an adapter cannot take its deployment's name {name!r}", "name")
    record = adapter_record(body)
    for version in _running_versions(session, dep):
        specs.check_engine(specs.version_fields(version), len(dep.adapters or []) + 1)
    dep.adapters = [*(dep.adapters or []), record]
    dep.max_adapters = dep.max_adapters or DEFAULT_MAX_ADAPTERS
    return _commit(request, session, who, dep, before, "add", f"adapter {body.name} added")


@router.delete("/{name}/adapters/{adapter}")
def remove_adapter(
    name: str,
    request: Request,
    session: SessionDep,
    who: PrincipalDep,
    adapter: AdapterName = Path(),
) -> dict:
    dep = _load(session, name, lock=True)
    before = _view(dep)
    kept = [a for a in dep.adapters or [] if a["name"] != adapter]
    if len(kept) == len(dep.adapters or []):
        raise not_found("adapter", adapter)
    dep.adapters = kept
    return _commit(request, session, who, dep, before, "remove", f"adapter {adapter} removed")
