"""Canary rollouts of a deployment: start one (an existing version, or a new one from
spec fields that does not become current), read it, promote or abort it by hand. The
rollout loop (`control_plane.rollouts.loop`) drives it in between."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from control_plane.api import specs
from control_plane.api.audit import audit, event
from control_plane.api.deps import PrincipalDep, SessionDep, kick
from control_plane.api.errors import conflict, invalid, not_found
from control_plane.api.routers.deployments import check_node_fit
from control_plane.api.schemas import DeploymentUpdate, Page, Strict
from control_plane.db.models import Deployment, DeploymentVersion, Rollout
from control_plane.rollouts.policy import (
    DEFAULT_STEPS,
    RolloutParams,
    canary_target,
    canary_weight,
    initial_state,
    operator,
)
from control_plane.rollouts.shadow import Comparison
from control_plane.rollouts.store import active_for, params_of, state_of, write_state

router = APIRouter(prefix="/v1/deployments", tags=["rollouts"])


class RolloutCreate(Strict):
    """Exactly one of `version` (an existing, non-current version) or `spec` (fields
    merged onto the current version, making a new one)."""

    version: int | None = Field(None, ge=1, le=2**31 - 1)
    spec: DeploymentUpdate | None = None
    steps: list[float] = Field(default_factory=lambda: list(DEFAULT_STEPS), min_length=1, max_length=20)
    step_duration_s: float = Field(120.0, gt=0, le=86_400)
    max_error_rate: float = Field(0.02, ge=0, le=1)
    max_ttft_p90_ratio: float = Field(1.3, gt=0, le=1000)
    min_requests: int = Field(50, ge=0, le=10_000_000)
    ready_timeout_s: float = Field(600.0, gt=0, le=86_400)
    # A shadow phase first (None: none): `shadow_share` of requests copied to the new
    # version for `shadow_duration_s`, judged on the guards below before any user sees it.
    shadow_share: float | None = Field(None, gt=0, le=1)
    shadow_duration_s: float | None = Field(None, gt=0, le=86_400)
    shadow_min_requests: int = Field(20, ge=1, le=10_000_000)
    shadow_max_error_rate_increase: float = Field(0.02, ge=0, le=1)
    shadow_max_ttft_p90_ratio: float = Field(1.5, gt=0, le=1000)
    shadow_max_itl_p90_ratio: float = Field(1.5, gt=0, le=1000)
    shadow_min_greedy_agreement: float = Field(0.9, ge=0, le=1)


class ShadowOut(BaseModel):
    """A rollout's shadow phase and the last comparison of copies with originals
    (`control_plane.rollouts.shadow.Comparison`)."""

    share: float
    duration_s: float
    phase: str | None  # running | passed | stopped
    reason: str
    requests: int = 0
    copies: int = 0
    dropped: int = 0
    compared: int = 0
    errors: dict[str, float | None] = Field(default_factory=dict)
    ttft_p50_s: dict[str, float | None] = Field(default_factory=dict)
    ttft_p90_s: dict[str, float | None] = Field(default_factory=dict)
    itl_p50_s: dict[str, float | None] = Field(default_factory=dict)
    itl_p90_s: dict[str, float | None] = Field(default_factory=dict)
    greedy: dict[str, float | int | None] = Field(default_factory=dict)


def shadow_out(row: Rollout) -> ShadowOut | None:
    if row.shadow_share is None:
        return None
    stats = Comparison.model_validate(row.shadow_stats or {}).as_json()
    return ShadowOut(
        share=row.shadow_share,
        duration_s=row.shadow_duration_s or 0.0,
        phase=row.shadow_phase,
        reason=row.shadow_reason or "",
        **stats,
    )


class RolloutOut(BaseModel):
    id: int
    deployment: str
    baseline_version: int
    canary_version: int
    phase: str
    active: bool
    step: int  # 1-based
    steps: list[float]
    canary_weight: float  # percent of traffic now
    canary_replicas: int  # wanted now
    params: dict[str, Any]
    reason: str
    last: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    shadow: ShadowOut | None = None  # None: no shadow phase


def rollout_out(row: Rollout, dep: Deployment) -> RolloutOut:
    params, state = params_of(row), state_of(row)
    return RolloutOut(
        id=row.id,
        deployment=dep.name,
        baseline_version=row.baseline_version,
        canary_version=row.canary_version,
        phase=row.phase,
        active=not state.terminal,
        step=row.step + 1,
        steps=list(params.steps),
        canary_weight=canary_weight(params, state),
        canary_replicas=canary_target(params, state, dep.replicas),
        params=params.model_dump(mode="json"),
        reason=row.reason,
        last=dict(row.last or {}),
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        shadow=shadow_out(row),
    )


def _deployment(session: Session, name: str) -> Deployment:
    dep = session.scalar(
        select(Deployment).where(Deployment.name == name).options(selectinload(Deployment.versions))
    )
    if dep is None:
        raise not_found("deployment", name)
    return dep


def _params(body: RolloutCreate) -> RolloutParams:
    try:
        return RolloutParams(
            steps=tuple(body.steps),
            step_duration_s=body.step_duration_s,
            max_error_rate=body.max_error_rate,
            max_ttft_p90_ratio=body.max_ttft_p90_ratio,
            min_requests=body.min_requests,
            ready_timeout_s=body.ready_timeout_s,
            **_shadow_params(body),
        )
    except ValidationError as err:
        first = err.errors()[0]
        raise invalid(
            str(first["loc"][0]) if first["loc"] else "steps", str(first["msg"]).removeprefix("Value error, ")
        ) from None


def _shadow_params(body: RolloutCreate) -> dict[str, Any]:
    if body.shadow_share is None:
        if body.shadow_duration_s is not None:
            raise invalid(
                "shadow_duration_s", "a shadow duration needs shadow_share (the share of requests to copy)"
            )
        return {}
    return {
        "shadow_share": body.shadow_share,
        "shadow_duration_s": body.shadow_duration_s
        or RolloutParams.model_fields["shadow_duration_s"].default,
        "shadow_min_requests": body.shadow_min_requests,
        "shadow_max_error_rate_increase": body.shadow_max_error_rate_increase,
        "shadow_max_ttft_p90_ratio": body.shadow_max_ttft_p90_ratio,
        "shadow_max_itl_p90_ratio": body.shadow_max_itl_p90_ratio,
        "shadow_min_greedy_agreement": body.shadow_min_greedy_agreement,
    }


@router.post("/{name}/rollouts", status_code=201, response_model=RolloutOut)
def start_rollout(name: str, body: RolloutCreate, request: Request, session: SessionDep, who: PrincipalDep):
    dep = _deployment(session, name)
    params = _params(body)
    if (body.version is None) == (body.spec is None):
        raise invalid("version", "give exactly one of version (an existing version) or spec (a new one)")
    running = active_for(session, dep.id)
    if running is not None:
        raise conflict(
            f"{name} already has an active rollout (v{running.baseline_version}->v{running.canary_version}, "
            f"{running.phase}); promote or abort it first",
            "deployment",
        )
    if body.version is not None:
        if dep.version_row(body.version) is None:
            raise not_found(f"version of {name}", body.version)
        if body.version == dep.current_version:
            raise invalid("version", f"version {body.version} is already the current version of {name}")
        specs.check_engine(specs.version_fields(dep.version_row(body.version)), specs.adapters_after(dep))
        canary = body.version
    else:
        assert body.spec is not None
        if body.spec.replicas is not None:
            raise invalid(
                "spec.replicas", "a rollout keeps the deployment's replica count; scale it separately"
            )
        current_spec = specs.version_fields(dep.version_row())
        spec, _ = specs.merged_spec(current_spec, dep.replicas, body.spec, specs.adapters_after(dep))
        if spec == current_spec:
            raise invalid("spec", "the spec equals the current version's; nothing to roll out")
        check_node_fit(session, spec)
        canary = max(v.version for v in dep.versions) + 1
        dep.versions.append(DeploymentVersion(version=canary, **spec))
    now = time.time()
    state = initial_state(params, now)
    row = Rollout(
        deployment_id=dep.id,
        baseline_version=dep.current_version,
        canary_version=canary,
        phase=state.phase,
        step=state.step,
        params=params.model_dump(mode="json"),
        phase_started_at=now,
        window_started_at=None,
        reason="",
        last={},
        revision=0,
        shadow_share=params.shadow_share,
        shadow_duration_s=params.shadow_duration_s if params.shadow_share is not None else None,
        shadow_phase=state.shadow,
        shadow_reason="",
    )
    session.add(row)
    session.flush()
    out = rollout_out(row, dep)
    audit(session, who, "rollout.start", "rollout", f"{name}/{row.id}", None, out)
    event(
        session,
        "rollout_started",
        f"{name} v{dep.current_version}->v{canary}: steps {', '.join(f'{s:g}%' for s in params.steps)}, "
        f"{params.step_duration_s:g}s each, max_error_rate={params.max_error_rate:g}, "
        f"max_ttft_p90_ratio={params.max_ttft_p90_ratio:g}, min_requests={params.min_requests}"
        + (
            f"; shadow phase first: {params.shadow_share:.0%} of requests for {params.shadow_duration_s:g}s"
            if params.shadow_share is not None
            else ""
        ),
        deployment=name,
    )
    session.commit()
    kick(request)
    return out


@router.get("/{name}/rollouts", response_model=Page[RolloutOut])
def list_rollouts(name: str, session: SessionDep, who: PrincipalDep):
    dep = _deployment(session, name)
    rows = session.scalars(
        select(Rollout).where(Rollout.deployment_id == dep.id).order_by(Rollout.id.desc())
    ).all()
    items = [rollout_out(r, dep) for r in rows]
    return Page(items=items, total=len(items), limit=max(1, len(items)), offset=0)


def _latest(session: Session, dep: Deployment) -> Rollout:
    row = active_for(session, dep.id) or session.scalar(
        select(Rollout).where(Rollout.deployment_id == dep.id).order_by(Rollout.id.desc())
    )
    if row is None:
        raise not_found(f"rollout of {dep.name}", "current")
    return row


@router.get("/{name}/rollouts/current", response_model=RolloutOut)
def current_rollout(name: str, session: SessionDep, who: PrincipalDep):
    dep = _deployment(session, name)
    return rollout_out(_latest(session, dep), dep)


def _end(name: str, action: str, request: Request, session: Session, who) -> RolloutOut:
    for _ in range(5):  # the loop may write the row between our read and write
        dep = _deployment(session, name)
        row = active_for(session, dep.id)
        if row is None:
            raise conflict(f"{name} has no active rollout to {action}", "deployment")
        state = operator(state_of(row), action, time.time(), who.actor)  # type: ignore[arg-type]
        if write_state(session, row, state, {**(row.last or {}), "status": state.reason}):
            kind = "rollout_promoted" if action == "promote" else "rollout_aborted"
            what = (
                f"v{row.canary_version} is now current"
                if action == "promote"
                else f"back to v{row.baseline_version}"
            )
            event(
                session,
                kind,
                f"{name} v{row.baseline_version}->v{row.canary_version}: {state.reason}; {what}",
                deployment=name,
            )
            audit(
                session,
                who,
                f"rollout.{action}",
                "rollout",
                f"{name}/{row.id}",
                {"phase": row.phase},
                {"phase": state.phase},
            )
            session.commit()
            session.expire_all()
            kick(request)
            dep = _deployment(session, name)
            return rollout_out(session.get(Rollout, row.id), dep)
        session.rollback()
        session.expire_all()
    raise conflict(f"the rollout of {name} kept changing; retry", "deployment")


@router.post("/{name}/rollouts/current/promote", response_model=RolloutOut)
def promote_rollout(name: str, request: Request, session: SessionDep, who: PrincipalDep):
    return _end(name, "promote", request, session, who)


@router.post("/{name}/rollouts/current/abort", response_model=RolloutOut)
def abort_rollout(name: str, request: Request, session: SessionDep, who: PrincipalDep):
    return _end(name, "abort", request, session, who)
