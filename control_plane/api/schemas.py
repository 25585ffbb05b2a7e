"""Request and response bodies of the admin API.

Requests are strict (no "3" for 3, no NaN), refuse unknown fields and bound every
number and string, so bad input is a 422 naming the field instead of a surprise later.
Names that become NATS subjects or KV keys (deployments, clusters, pools) are limited to
characters valid there.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from control_plane.cost.budgets import DEFAULT_THRESHOLDS
from control_plane.cost.budgets import Fraction as BudgetFraction
from control_plane.placement.base import PriorityClass as DeploymentPriority
from control_plane.rollouts.surge import check_budget
from fleet_base.batch.models import AsyncRecord, BatchRecord
from fleet_base.domain import (
    MAX_GPU_MEMORY_GB,
    AdapterName,
    ClusterId,
    DeploymentName,
    PoolName,
    PoolShape,
    PriorityClassName,
    TeamName,
)
from fleet_base.engines import EngineKind
from fleet_base.pipelines import MAX_STEPS, PipelineName, PipelineSpec, StepName
from fleet_base.residency import MAX_JURISDICTIONS, normalize, parse_residency

MAX_REPLICAS = 1000
MAX_LIST = 64

Label = Annotated[
    str, StringConstraints(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.*:/-]*$")
]
# A model alias, path or URI: printable (no control characters: a path or URI never has one).
ModelRef = Annotated[
    str,
    StringConstraints(min_length=1, max_length=512, strip_whitespace=True, pattern=r"^[^\x00-\x1f\x7f]+$"),
]
# An engine flag without its dashes, stored lower case with '_' for '-': one spelling per flag,
# the one argv builders take (fleet_base.engines.ENGINE_ARG_KEY) and turn back into
# `--flag-name`. Which keys an engine takes is decided here and in
# fleet_base.engines.deployment_problems, at deploy time, never first by an agent.
EngineArgName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"),
    AfterValidator(lambda key: key.replace("-", "_").lower()),
]
Url = Annotated[str, StringConstraints(max_length=512, pattern=r"^(https?://\S+)?$")]
Scope = Literal["admin", "read", "inference", "metrics"]
TierName = Literal["reserved", "on-demand", "spot"]
ClusterStatusName = Literal["healthy", "unhealthy", "draining"]


def _jurisdiction(value: str) -> str:
    return normalize(value) if value.strip() else ""


def _residency(value: list[str] | None) -> list[str] | None:
    return None if value is None else parse_residency(value)


# A cluster's jurisdiction (fleet_base.residency), lower-cased; "" = none (outside every policy).
JurisdictionLabel = Annotated[str, StringConstraints(max_length=64), AfterValidator(_jurisdiction)]
# A residency policy: the jurisdictions allowed, at least one; null = no policy.
ResidencyPolicy = Annotated[
    list[Annotated[str, StringConstraints(max_length=64)]] | None,
    Field(max_length=MAX_JURISDICTIONS),
    AfterValidator(_residency),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# --------------------------------------------------------------------- deployments


class ScalingSpec(Strict):
    min_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    max_replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS)
    # at most an hour, as the autoscaler's own settings take them (control_plane.autoscale.policy)
    autoscale_window_s: float | None = Field(None, gt=0, le=3600)
    scale_down_delay_s: float | None = Field(
        None,
        ge=0,
        le=3600,
        description="default: derived from the cold start; null in an update: back to it",
    )
    target_concurrency: float | None = Field(None, gt=0, le=100_000)
    scale_to_zero: bool | None = None
    slo_ttft_s: float | None = Field(None, gt=0, le=3600, description="TTFT target (default 2 s)")
    slo_itl_s: float | None = Field(
        None, gt=0, le=60, description="inter-token latency target (default 0.1 s)"
    )


class SpecFields(ScalingSpec):
    """Every field of a version; None means "not given" (defaults on create, unchanged
    on update)."""

    model: ModelRef | None = None
    engine: EngineKind | None = Field(
        None, description="the server that runs replicas: fleet (default), vllm, sglang or llama.cpp"
    )
    engine_args: dict[EngineArgName, Any] | None = Field(None, max_length=MAX_LIST)
    gpu_models: list[Label] | None = Field(None, max_length=MAX_LIST)
    gpu_count: int | None = Field(None, ge=1, le=64)
    gpu_memory_gb: float | None = Field(None, ge=0, le=MAX_GPU_MEMORY_GB)
    regions: list[Label] | None = Field(None, max_length=MAX_LIST)
    min_regions: int | None = Field(None, ge=1, le=MAX_LIST)
    standby_regions: list[Label] | None = Field(
        None, max_length=MAX_LIST
    )  # warm, no traffic while primaries live
    replicas: int | None = Field(None, ge=0, le=MAX_REPLICAS)

    @field_validator("engine_args")
    @classmethod
    def _scalar_args(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, arg in (value or {}).items():
            if not isinstance(arg, (str, int, float, bool)) or (isinstance(arg, str) and len(arg) > 4096):
                raise ValueError(f"{key!r} must be a string (up to 4096 characters), number or boolean")
            if (isinstance(arg, float) and arg != arg) or arg in (float("inf"), float("-inf")):
                raise ValueError(f"{key!r} must be finite")
        return value

    @field_validator("gpu_models", "regions", "standby_regions")
    @classmethod
    def _unique(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("duplicate entries")
        return value


class PolicyFields(Strict):
    """Per-deployment, unversioned: the placement class and the rollout surge budget
    (a replica count, or a percentage of the desired replicas such as "25%")."""

    priority: DeploymentPriority | None = None
    max_surge: int | str | None = Field(None, description='replicas above the desired count: 2 or "25%"')
    max_unavailable: int | str | None = Field(
        None, description='replicas allowed not ready during a rollout: 1 or "25%"'
    )

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _budget(cls, value: int | str | None) -> str | None:
        if value is None:
            return None
        if isinstance(value, int):
            if not 0 <= value <= MAX_REPLICAS:
                raise ValueError(f"a replica count must be within 0..{MAX_REPLICAS}")
            return str(value)
        return check_budget(value.strip())


class AdapterIn(Strict):
    """A LoRA adapter: the name clients send as `model`, and its PEFT files' model URI."""

    name: AdapterName
    uri: ModelRef


class AdapterFields(Strict):
    """Per-deployment, unversioned: LoRA adapters and how many one replica holds at once."""

    adapters: list[AdapterIn] | None = Field(None, max_length=MAX_LIST)
    max_adapters: int | None = Field(None, ge=0, le=64, description="adapters per replica (0: LoRA off)")

    @field_validator("adapters")
    @classmethod
    def _unique_names(cls, value: list[AdapterIn] | None) -> list[AdapterIn] | None:
        names = [a.name for a in value or []]
        if len(set(names)) != len(names):
            raise ValueError("duplicate adapter names")
        return value


class ResidencyFields(Strict):
    """Per-deployment, unversioned: the jurisdictions its replicas may run and its requests
    be processed in. Given as null on an update it clears the policy."""

    residency: ResidencyPolicy = Field(None, description='jurisdictions allowed, e.g. ["ca"]; null: any')


class DeploymentCreate(SpecFields, PolicyFields, AdapterFields, ResidencyFields):
    """Create a deployment (version 1). With `replicas` alone the count is pinned
    (min = max = replicas); give min/max replicas for an autoscaled range."""

    name: DeploymentName
    model: ModelRef


class DeploymentUpdate(SpecFields, PolicyFields, AdapterFields, ResidencyFields):
    """Change some fields. A changed spec makes a new version; `replicas` alone only scales."""


class ScaleRequest(PolicyFields):
    replicas: int = Field(ge=0, le=MAX_REPLICAS)


class VersionOut(BaseModel):
    version: int
    model: str
    engine: str = "fleet"
    engine_args: dict[str, Any]
    gpu_models: list[str]
    gpu_count: int
    gpu_memory_gb: float
    min_replicas: int
    max_replicas: int
    autoscale_window_s: float
    scale_down_delay_s: float | None = None  # None: derived from the cold start
    target_concurrency: float
    scale_to_zero: bool
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    regions: list[str]
    min_regions: int
    standby_regions: list[str] = []
    created_at: datetime
    replicas: int = 0  # assignments of this version
    current: bool = False


class Placement(BaseModel):
    replica_id: str
    cluster: str
    region: str
    pool: str
    version: int
    state: str
    url: str
    gpus: int
    # cold start in parts, seconds, as the agent measured it: cold_start, pull, load, warmup, first_token
    startup: dict[str, float | None] = {}


class DeploymentSummary(BaseModel):
    name: str
    model: str
    engine: str = "fleet"  # the current version's
    current_version: int
    desired_replicas: int
    ready_replicas: int
    min_replicas: int
    max_replicas: int
    priority: str = "standard"
    max_surge: str = "25%"
    max_unavailable: str = "25%"
    adapters: list[AdapterIn] = Field(default_factory=list)
    max_adapters: int = 0
    residency: list[str] | None = None
    created_at: datetime
    updated_at: datetime


class DeploymentStatus(DeploymentSummary):
    """`GET /v1/deployments/{name}`: what is wanted (current version, desired replicas)
    and what runs (placements, ready replicas of any version)."""

    spec: VersionOut
    versions: list[VersionOut]
    placements: list[Placement]


# --------------------------------------------------------------------- clusters and pools


class PoolIn(PoolShape, Strict):
    """A pool registered by hand: the pool shape, strictly typed, under a pool name."""

    name: PoolName
    gpu_model: Label
    tier: TierName = "on-demand"


class PoolOut(PoolShape):
    cluster: str
    region: str
    jurisdiction: str = ""  # its cluster's: where residency lets replicas run
    name: str
    tier: str
    total_gpus: int
    used_gpus: int
    free_gpus: int


class ClusterCreate(Strict):
    id: ClusterId
    provider: Label = "local"
    region: Annotated[str, StringConstraints(max_length=63, pattern=r"^[A-Za-z0-9_.-]*$")] = ""
    lat: float = Field(0.0, ge=-90, le=90)
    lon: float = Field(0.0, ge=-180, le=180)
    gateway_url: Url = ""
    status: Literal["healthy", "draining"] = "healthy"
    jurisdiction: JurisdictionLabel = ""
    pools: list[PoolIn] = Field(default_factory=list, max_length=MAX_LIST)

    @field_validator("pools")
    @classmethod
    def _unique_pools(cls, pools: list[PoolIn]) -> list[PoolIn]:
        names = [p.name for p in pools]
        if len(set(names)) != len(names):
            raise ValueError("duplicate pool names")
        return pools


class ClusterUpdate(Strict):
    status: Literal["healthy", "draining"] | None = None
    provider: Label | None = None
    region: Annotated[str, StringConstraints(max_length=63, pattern=r"^[A-Za-z0-9_.-]*$")] | None = None
    lat: float | None = Field(None, ge=-90, le=90)
    lon: float | None = Field(None, ge=-180, le=180)
    gateway_url: Url | None = None
    jurisdiction: JurisdictionLabel | None = Field(None, description='e.g. "ca"; "" clears it')


class ClusterOut(BaseModel):
    id: str
    provider: str
    region: str
    lat: float
    lon: float
    status: str
    gateway_url: str
    jurisdiction: str = ""
    last_heartbeat_at: datetime | None
    load: dict[str, Any]
    created_at: datetime
    replicas: int
    pools: list[PoolOut]


# --------------------------------------------------------------------- keys


class DeploymentLimitsIn(Strict):
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    requests_per_minute: int | None = Field(None, ge=1, le=10**9)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)


class QuotasIn(Strict):
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    requests_per_minute: int | None = Field(None, ge=1, le=10**9)
    max_concurrent: int | None = Field(None, ge=1, le=10**6)
    priority: int = Field(0, ge=-10, le=10)
    # budgets (docs/quotas.md)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)
    deployments: dict[DeploymentName, DeploymentLimitsIn] = Field(default_factory=dict, max_length=1000)
    priority_class: PriorityClassName | None = None


class KeyUpdate(Strict):
    """PATCH /v1/keys/{id}: fields given replace the key's; `quotas` fields given replace
    those quotas (null clears a limit), the others stay."""

    name: (
        Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")] | None
    ) = None
    deployments: list[DeploymentName] | None = Field(None, max_length=1000)
    quotas: dict[str, Any] | None = None
    residency: ResidencyPolicy = Field(None, description="jurisdictions allowed; null clears the policy")
    team: TeamName | None = Field(None, description="the team charged for its usage; null clears it")


class KeyCreate(Strict):
    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
    scopes: list[Scope] = Field(default_factory=lambda: ["inference"], min_length=1, max_length=3)
    deployments: list[DeploymentName] | None = Field(None, max_length=1000)
    quotas: QuotasIn = Field(default_factory=QuotasIn)
    residency: ResidencyPolicy = Field(None, description='jurisdictions allowed, e.g. ["ca"]; null: any')
    team: TeamName | None = Field(None, description="the team charged for its usage (docs/cost.md)")

    @field_validator("scopes")
    @classmethod
    def _unique_scopes(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("duplicate scopes")
        return value


class KeyOut(BaseModel):
    key_id: str
    name: str
    scopes: list[str]
    deployments: list[str] | None
    quotas: dict[str, Any]
    residency: list[str] | None = None
    team: str | None = None
    created_at: datetime
    revoked_at: datetime | None
    revoked: bool


class KeyCreated(KeyOut):
    key: str = Field(description="the secret: shown once, never stored")
    webhook_secret: str | None = Field(
        None,
        description="the key's webhook signing secret (Standard Webhooks, whsec_...): shown once, "
        "never stored; None when the control plane has no webhook master secret",
    )


class WebhookSecretOut(BaseModel):
    """POST /v1/keys/{id}/webhook-secret: the new signing secret, shown once."""

    key_id: str
    webhook_secret: str
    webhook_secret_version: int


# --------------------------------------------------------------------- team budgets


class BudgetIn(Strict):
    """PUT /v1/budgets/{team}: the whole budget (fields left out take their defaults)."""

    monthly_dollars: float = Field(
        ge=0.01, le=1e12, description="dollars per calendar month (UTC), a cent or more"
    )
    thresholds: list[BudgetFraction] = Field(
        default_factory=lambda: list(DEFAULT_THRESHOLDS),
        min_length=1,
        max_length=16,
        description="fractions of the budget to alert at, each in (0, 1]",
    )
    hard: bool = Field(False, description="refuse the team's keys (429) once the month's budget is spent")


class BudgetOut(BaseModel):
    team: str
    monthly_dollars: float
    thresholds: list[float]
    hard: bool
    month: str = Field(description="the calendar month (UTC) the figures are about, YYYY-MM")
    spent_dollars: float | None = Field(description="dollars spent this month; null: the cost report failed")
    used_ratio: float | None
    exhausted: bool = Field(description="hard and spent: gateways refuse the team's keys")
    alerted: list[float] = Field(description="thresholds already alerted this month")
    updated_at: datetime


# --------------------------------------------------------------------- events and audit


class EventOut(BaseModel):
    id: int
    at: datetime
    cluster: str | None
    kind: str
    deployment: str | None
    replica_id: str | None
    message: str


class AuditOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    resource_type: str
    resource_id: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None


# --------------------------------------------------------------------- nodes


class NodeActionIn(Strict):
    reason: str = Field("", max_length=512)


class NodeActionOut(BaseModel):
    """The operator's latest word on a node, as published to its agent."""

    action: Literal["cordon", "uncordon"]
    at: datetime
    reason: str
    by: str


class NodeOut(BaseModel):
    cluster: str
    node: str
    state: str  # fleet_base.node_health.NodeState
    reason: str
    failures: int  # node faults stored for it (not an out-of-memory nor an application XID)
    since: datetime
    gpus: int
    gpus_withheld: list[int]
    cordoned_by: str
    nvml: str  # "" when the agent reads NVML, else why not
    pool: str
    last_fault_at: datetime | None
    updated_at: datetime
    operator: NodeActionOut | None


class NodeFaultOut(BaseModel):
    fault_id: str
    at: datetime
    node: str
    gpu: int | None
    kind: str  # fleet_base.node_health.FaultKind
    node_fault: bool  # False for what is not the node's doing (an out-of-memory, an application XID)
    evidence: str
    replica_id: str | None
    deployment: str | None
    pool: str
    provider: str


class NodeDetailOut(NodeOut):
    faults: list[NodeFaultOut]  # the latest first


# --------------------------------------------------------------------- lists

T = TypeVar("T")


# --------------------------------------------------------------------- pipelines


class PipelineStepIn(Strict):
    name: StepName
    deployment: DeploymentName


class PipelineCreate(Strict):
    """`POST /v1/pipelines`: a `fleet_base.pipelines.PipelineSpec`, strictly typed; `spec()`
    applies the spec's own rules (distinct step names and deployments)."""

    name: PipelineName
    steps: list[PipelineStepIn] = Field(min_length=1, max_length=MAX_STEPS)
    slo_e2e_s: float | None = Field(None, gt=0, le=3600)

    def spec(self) -> PipelineSpec:
        return PipelineSpec.model_validate(self.model_dump())


class PipelineStepOut(BaseModel):
    name: str
    deployment: str


class PipelineSummary(BaseModel):
    """`ready_clusters`: the clusters where every step has a ready replica (where a new
    pipeline request can be served whole)."""

    name: str
    steps: list[PipelineStepOut]
    slo_e2e_s: float | None = None
    ready_clusters: list[str] = Field(default_factory=list)
    created_at: datetime
    updated_at: datetime


class PipelineClusterReadiness(BaseModel):
    """One cluster: ready replicas of each step there, and `ready` when every step has one."""

    cluster: str
    region: str = ""
    ready: bool
    steps: dict[str, int]


class PipelineStatus(PipelineSummary):
    """`GET /v1/pipelines/{name}`: the spec and, for every registered cluster, its readiness."""

    clusters: list[PipelineClusterReadiness]


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


class ControlPlaneMemberOut(BaseModel):
    id: str
    url: str
    is_leader: bool
    last_seen: datetime
    started_at: datetime


class ControlPlaneOut(BaseModel):
    """The control-plane instances on this database: who holds the lease, under which
    epoch, and whether the instance that answers is the leader."""

    leader: str | None
    epoch: int
    members: list[ControlPlaneMemberOut]
    is_leader: bool


class BatchOut(BatchRecord):
    """A batch as the admin API shows it (every key's): the stored record, with the name of
    the key that owns it."""

    key_name: str | None = None


class AsyncRequestOut(AsyncRecord):
    """An async request as the admin API shows it: the record without its result (a
    caller's data, fetched by the caller's own key), with the owner key's name."""

    key_name: str | None = None
