"""The autoscaler's memory in the database (`autoscaler_states`), one row per autoscaled
deployment: the leader writes each deployment's `ScalerSnapshot` at most every `SAVE_S`
(its cycles, the bulk of it and slow to learn, at most every `CYCLES_SAVE_S`) and only
when it changed, in the tick's own transaction (fenced with the decisions it goes with); a
new leader reads them on its first tick. A row is keyed by the deployment's id, so a
deployment deleted and created again under its name starts afresh."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from control_plane.autoscale.snapshot import ScalerSnapshot, load
from control_plane.db.models import AutoscalerState

SAVE_S = 5.0  # how often the memory is stored: what a new leader may miss of it
CYCLES_SAVE_S = 60.0  # the cycles: a minute of a 15-minute slot's mean


def read_states(session: Session) -> dict[int, tuple[str, ScalerSnapshot]]:
    """deployment id -> (policy, snapshot); a row that no longer parses is left out (that
    deployment's autoscaler starts afresh, as after a restart)."""
    out: dict[int, tuple[str, ScalerSnapshot]] = {}
    for row in session.scalars(select(AutoscalerState)).all():
        try:
            out[row.deployment_id] = (row.policy, load(row.state, row.cycles))
        except ValueError:
            continue
    return out


def write_state(
    session: Session, deployment_id: int, policy: str, text: str, at: float, cycles: str | None = None
) -> None:
    """The memory (`text`), and its cycles when given (else the stored ones stay)."""
    row = session.get(AutoscalerState, deployment_id)
    if row is None:
        row = AutoscalerState(deployment_id=deployment_id, policy=policy, state=text, at=at)
        session.add(row)
    else:
        row.policy, row.state, row.at = policy, text, at
    if cycles is not None:
        row.cycles = cycles


def forget_others(session: Session, keep: set[int]) -> None:
    """Drop the rows of deployments that are no longer autoscaled (or gone)."""
    session.execute(delete(AutoscalerState).where(AutoscalerState.deployment_id.not_in(sorted(keep))))
