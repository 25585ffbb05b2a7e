"""Pipelines as stored (`db.models.Pipeline`), read back as `fleet_base.pipelines.PipelineSpec`:
the one reader every part of the control plane uses (placer, routing table, autoscaler, API).

A step names a deployment by name. A pipeline's deployments must exist when it is created,
and a deployment cannot be deleted while a pipeline names it (`pipelines_using`; the API
answers 409 naming them): removing a step silently would break the pipeline's callers, so
the operator deletes or recreates the pipeline first.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Deployment, Pipeline
from fleet_base.pipelines import PipelineSpec

log = logging.getLogger(__name__)


def spec_of(row: Pipeline) -> PipelineSpec:
    return PipelineSpec.model_validate({"name": row.name, "steps": row.steps, "slo_e2e_s": row.slo_e2e_s})


def row_of(spec: PipelineSpec) -> Pipeline:
    return Pipeline(name=spec.name, steps=[s.model_dump() for s in spec.steps], slo_e2e_s=spec.slo_e2e_s)


def load_pipelines(session: Session) -> list[PipelineSpec]:
    """Every stored pipeline, by name. A row that no longer validates (written by a newer
    or older release) is logged and left out, never half-read."""
    specs = []
    for row in session.scalars(select(Pipeline).order_by(Pipeline.name)).all():
        try:
            specs.append(spec_of(row))
        except ValidationError as exc:
            log.warning("pipeline %r left out: %s", row.name, exc)
    return specs


def load_pipeline(session: Session, name: str) -> Pipeline | None:
    return session.scalars(select(Pipeline).where(Pipeline.name == name)).one_or_none()


def missing_deployments(session: Session, spec: PipelineSpec, lock: bool = False) -> list[str]:
    """The deployments `spec`'s steps name that do not exist, in step order. `lock` holds
    the existing ones' rows until commit (PostgreSQL), against a concurrent delete."""
    query = select(Deployment.name).where(Deployment.name.in_(spec.deployments))
    known = set(session.scalars(query.with_for_update() if lock else query).all())
    return [d for d in spec.deployments if d not in known]


def pipelines_using(session: Session, deployment: str) -> list[str]:
    """The pipelines with a step on `deployment`, by name."""
    return [p.name for p in load_pipelines(session) if deployment in p.deployments]
