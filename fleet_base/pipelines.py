"""A pipeline: deployments that serve one request together (embed, rerank, answer), each
scaled on its own, placed in the same clusters so step-to-step calls never leave one.

One shape for the admin API, the placer, the routing table the gateways read and the
simulator. The step names are what callers and metrics use (`X-Fleet-Pipeline-Step`);
the deployments are ordinary deployments that may also serve traffic of their own.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from fleet_base.domain import DEPLOYMENT_NAME_PATTERN, DeploymentName

PipelineName = Annotated[str, StringConstraints(pattern=DEPLOYMENT_NAME_PATTERN, min_length=1, max_length=63)]
StepName = Annotated[str, StringConstraints(pattern=DEPLOYMENT_NAME_PATTERN, min_length=1, max_length=63)]

# Request headers of pipeline traffic: the pipeline a request belongs to, the step it calls,
# and the id that ties one pipeline request's hops together (latency per hop, usage records).
PIPELINE_HEADER = "X-Fleet-Pipeline"
PIPELINE_STEP_HEADER = "X-Fleet-Pipeline-Step"
PIPELINE_REQUEST_HEADER = "X-Fleet-Pipeline-Request"

MAX_STEPS = 16


class PipelineStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: StepName
    deployment: DeploymentName


class PipelineSpec(BaseModel):
    """Steps in call order. `slo_e2e_s`: the end-to-end latency budget the steps share (None:
    each step keeps its own SLO alone)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: PipelineName
    steps: tuple[PipelineStep, ...] = Field(min_length=1, max_length=MAX_STEPS)
    slo_e2e_s: float | None = Field(default=None, gt=0, le=3600)

    @model_validator(mode="after")
    def _distinct(self) -> PipelineSpec:
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"step names repeat: {', '.join(names)}")
        deployments = [s.deployment for s in self.steps]
        if len(set(deployments)) != len(deployments):
            raise ValueError(f"a deployment serves one step per pipeline: {', '.join(deployments)}")
        return self

    @property
    def deployments(self) -> tuple[str, ...]:
        return tuple(s.deployment for s in self.steps)

    def step(self, name: str) -> PipelineStep | None:
        return next((s for s in self.steps if s.name == name), None)
