"""Rollout rows <-> policy state, and the one transaction that applies a decision
(state, event and, on promotion, the deployment's current version together)."""

from __future__ import annotations

from pydantic import BaseModel
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.db.models import Deployment, Event, Rollout, utcnow
from control_plane.rollouts.policy import (
    TERMINAL,
    Decision,
    RolloutParams,
    RolloutState,
    canary_target,
    canary_weight,
    shadow_share,
)


class RolloutPlan(BaseModel):
    """What reconcile needs of an active rollout: two versions, the canary's replica
    target and its share of traffic (percent)."""

    deployment: str
    baseline_version: int
    canary_version: int
    canary_replicas: int
    canary_weight: float
    shadow_share: float | None = None  # while its shadow phase copies requests to the canary
    shadowing: bool = False  # in the shadow phase (copying, or waiting for the canary's replicas)


def params_of(row: Rollout) -> RolloutParams:
    return RolloutParams.model_validate(row.params or {})


def state_of(row: Rollout) -> RolloutState:
    return RolloutState(
        phase=row.phase,  # type: ignore[arg-type]
        step=row.step,
        phase_started_at=row.phase_started_at,
        window_started_at=row.window_started_at,
        reason=row.reason,
        shadow=row.shadow_phase,  # type: ignore[arg-type]
        shadow_reason=row.shadow_reason or "",
    )


def active_filter():
    return Rollout.phase.not_in(sorted(TERMINAL))


def active_for(session: Session, deployment_id: int) -> Rollout | None:
    return session.scalar(
        select(Rollout)
        .where(Rollout.deployment_id == deployment_id, active_filter())
        .order_by(Rollout.id.desc())
    )


def active_rows(session: Session) -> list[tuple[Rollout, str, int]]:
    """Every active rollout with its deployment's name and replica count, oldest first."""
    rows = session.execute(
        select(Rollout, Deployment.name, Deployment.replicas)
        .join(Deployment, Deployment.id == Rollout.deployment_id)
        .where(active_filter())
        .order_by(Rollout.id)
    ).all()
    return [(row, name, replicas) for row, name, replicas in rows]


def plans(session: Session) -> dict[str, RolloutPlan]:
    """Active rollouts by deployment name."""
    out: dict[str, RolloutPlan] = {}
    for row, name, replicas in active_rows(session):
        params, state = params_of(row), state_of(row)
        out[name] = RolloutPlan(
            deployment=name,
            baseline_version=row.baseline_version,
            canary_version=row.canary_version,
            canary_replicas=canary_target(params, state, replicas),
            canary_weight=canary_weight(params, state),
            shadow_share=shadow_share(params, state),
            shadowing=state.phase == "shadowing",
        )
    return out


def write_state(
    session: Session,
    row: Rollout,
    state: RolloutState,
    numbers: dict | None = None,
    shadow_stats: dict | None = None,
) -> bool:
    """Store `state` (and the shadow comparison, when given) if nobody wrote the row since
    it was read (its revision); on promotion the canary becomes the deployment's current
    version in the same transaction. False: lost the race, nothing written."""
    values = {
        "shadow_phase": state.shadow,
        "shadow_reason": state.shadow_reason,
        "phase": state.phase,
        "step": state.step,
        "phase_started_at": state.phase_started_at,
        "window_started_at": state.window_started_at,
        "reason": state.reason,
        "revision": row.revision + 1,
        "updated_at": utcnow(),
    }
    if numbers is not None:
        values["last"] = numbers
    if shadow_stats is not None:
        values["shadow_stats"] = shadow_stats
    if state.phase in TERMINAL:
        values["finished_at"] = utcnow()
    done = session.execute(
        update(Rollout)
        .where(Rollout.id == row.id, Rollout.revision == row.revision)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if done.rowcount != 1:
        return False
    if state.phase == "promoted":
        session.execute(
            update(Deployment)
            .where(Deployment.id == row.deployment_id)
            .values(current_version=row.canary_version, updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    return True


EVENT_KINDS = {
    "step_started": "rollout_step",
    "advance": "rollout_step",
    "promote": "rollout_promoted",
    "rollback": "rollout_rolled_back",
    "abort": "rollout_aborted",
    "shadow_started": "rollout_shadow",
    "shadow_passed": "rollout_shadow",
    "shadow_stopped": "rollout_rolled_back",
}


def numbers_text(numbers: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in numbers.items() if v is not None)


def record(session: Session, deployment: str, row: Rollout, decision: Decision) -> None:
    """The decision as an event with its numbers."""
    session.add(
        Event(
            kind=EVENT_KINDS.get(decision.action, "rollout"),
            deployment=deployment,
            message=(
                f"{deployment} v{row.baseline_version}->v{row.canary_version}: {decision.message} "
                f"[{numbers_text(decision.numbers)}]"
            ),
        )
    )
