"""The control plane's tables (SQLAlchemy 2.0, typed). Schema changes go through Alembic
(`migrations/`); these classes are the source autogenerate compares against.

Enum-like columns (cluster status, replica state, pool tier) are plain strings holding
`fleet_base.protocol` enum values, so a new value never needs a database enum migration.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names so Alembic batch mode (SQLite) and PostgreSQL agree.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend: SQLite drops the offset, so
    values are stored as UTC and come back with tzinfo=UTC (comparable with `utcnow()`)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[str]: JSON, datetime: UTCDateTime()}


class Deployment(Base):
    """A named model service. `replicas` is the desired count (set by create, `scale` or
    the autoscaler), kept within the current version's min..max."""

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), unique=True, index=True)
    replicas: Mapped[int] = mapped_column(Integer, default=1)
    # The autoscaler's cheapest mix of GPU types (gpu model -> replicas); empty: any.
    variant_mix: Mapped[dict[str, Any]] = mapped_column(default=dict)
    current_version: Mapped[int] = mapped_column(Integer, default=1)
    # Placement class (critical, standard, batch) and the rollout surge budget (a count or a
    # percentage of `replicas`): per deployment, not per version, so changing them never
    # starts a rollout.
    priority: Mapped[str] = mapped_column(String(16), default="standard", server_default="standard")
    max_surge: Mapped[str] = mapped_column(String(16), default="25%", server_default="25%")
    max_unavailable: Mapped[str] = mapped_column(String(16), default="25%", server_default="25%")
    # Multi-LoRA, unversioned (adding an adapter never restarts replicas): [{name, uri}] and
    # how many one replica holds at once (0 = LoRA off).
    adapters: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list, server_default="[]")
    max_adapters: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Data residency, unversioned (changing it moves replicas, it starts no rollout): the
    # jurisdictions the deployment's requests may be processed in; None: no policy.
    residency: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    versions: Mapped[list[DeploymentVersion]] = relationship(
        back_populates="deployment",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="DeploymentVersion.version",
    )
    assignments: Mapped[list[ReplicaAssignment]] = relationship(
        back_populates="deployment", cascade="all, delete-orphan", passive_deletes=True
    )

    def version_row(self, version: int | None = None) -> DeploymentVersion | None:
        want = self.current_version if version is None else version
        return next((v for v in self.versions if v.version == want), None)


class DeploymentVersion(Base):
    """One immutable spec of a deployment. A spec change makes version N+1."""

    __tablename__ = "deployment_versions"
    __table_args__ = (UniqueConstraint("deployment_id", "version", name="uq_deployment_versions_dep_ver"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(512))
    # The server that runs it (fleet_base.engines.EngineKind): a new engine is a new version.
    engine: Mapped[str] = mapped_column(String(16), default="fleet", server_default="fleet")
    engine_args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    gpu_models: Mapped[list[str]] = mapped_column(default=list)  # empty: any
    gpu_count: Mapped[int] = mapped_column(Integer, default=1)
    gpu_memory_gb: Mapped[float] = mapped_column(Float, default=0.0)
    min_replicas: Mapped[int] = mapped_column(Integer, default=1)
    max_replicas: Mapped[int] = mapped_column(Integer, default=1)
    autoscale_window_s: Mapped[float] = mapped_column(Float, default=60.0)
    # None: derived by the policy from the measured cold start (autoscale.policy.UNSET_SCALE_DOWN_DELAY_S)
    scale_down_delay_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)
    target_concurrency: Mapped[float] = mapped_column(Float, default=8.0)
    scale_to_zero: Mapped[bool] = mapped_column(Boolean, default=False)
    slo_ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)  # None: 2 s
    slo_itl_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)  # None: 0.1 s
    regions: Mapped[list[str]] = mapped_column(default=list)  # empty: any
    min_regions: Mapped[int] = mapped_column(Integer, default=1)
    standby_regions: Mapped[list[str]] = mapped_column(default=list)  # warm, at min_replicas, no traffic
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    deployment: Mapped[Deployment] = relationship(back_populates="versions")


class Cluster(Base):
    """A cluster an agent runs; `id` is the agent's cluster id. Registered through the
    API or by its first heartbeat."""

    __tablename__ = "clusters"

    id: Mapped[str] = mapped_column(String(63), primary_key=True)
    provider: Mapped[str] = mapped_column(String(63), default="local")
    region: Mapped[str] = mapped_column(String(63), default="", index=True)
    lat: Mapped[float] = mapped_column(Float, default=0.0)
    lon: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[str] = mapped_column(String(16), default="healthy")  # fleet_base.domain.ClusterStatus
    gateway_url: Mapped[str] = mapped_column(String(512), default="")
    # Set by the operator (enrolment, `clusters set`), never by heartbeats: "" is outside
    # every residency policy (fleet_base.residency).
    jurisdiction: Mapped[str] = mapped_column(String(32), default="", server_default="")
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(nullable=True)
    load: Mapped[dict[str, Any]] = mapped_column(default=dict)  # last heartbeat summary
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    pools: Mapped[list[CapacityPool]] = relationship(
        back_populates="cluster",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="CapacityPool.name",
    )

    def set_pool(self, existing: dict[str, CapacityPool], name: str, shape: dict[str, Any]) -> str:
        """Make pool `name` (taken out of `existing`, the pools not set yet, by name) have
        `shape`: "created", "updated" or "unchanged". Heartbeats and catalog imports both
        keep a cluster's pools this way."""
        row = existing.pop(name, None)
        if row is None:
            self.pools.append(CapacityPool(name=name, **shape))
            return "created"
        if all(getattr(row, k) == v for k, v in shape.items()):
            return "unchanged"
        for k, v in shape.items():
            setattr(row, k, v)
        return "updated"


class CapacityPool(Base):
    """GPUs of one kind a cluster offers: `nodes * gpus_per_node` GPUs of `gpu_model`."""

    __tablename__ = "capacity_pools"
    __table_args__ = (UniqueConstraint("cluster_id", "name", name="uq_capacity_pools_cluster_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    gpu_model: Mapped[str] = mapped_column(String(63))
    gpu_memory_gb: Mapped[float] = mapped_column(Float, default=0.0)
    gpus_per_node: Mapped[int] = mapped_column(Integer, default=1)
    nodes: Mapped[int] = mapped_column(Integer, default=1)
    tier: Mapped[str] = mapped_column(String(16), default="on-demand")  # fleet_base.domain.Tier
    hourly_price: Mapped[float] = mapped_column(Float, default=0.0)

    cluster: Mapped[Cluster] = relationship(back_populates="pools")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class ReplicaAssignment(Base):
    """A replica placed on a cluster's pool; written by the reconcile loop, its state
    updated from heartbeats."""

    __tablename__ = "replica_assignments"

    replica_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id"), index=True)
    pool_name: Mapped[str] = mapped_column(String(63), default="")
    gpus: Mapped[int] = mapped_column(Integer, default=1)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # fleet_base.protocol.ReplicaState
    url: Mapped[str] = mapped_column(String(512), default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    deployment: Mapped[Deployment] = relationship(back_populates="assignments")
    cluster: Mapped[Cluster] = relationship()


class ApiKey(Base):
    """An admin/read/inference key: salt and SHA-256 only, never the secret."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    salt: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[list[str]] = mapped_column(default=lambda: ["inference"])
    deployments: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)  # None: all
    quotas: Mapped[dict[str, Any]] = mapped_column(default=dict)  # fleet_base.api_keys.Quotas
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # cluster id -> fraction of the key's token budgets (ApiKeyRecord.shares; docs/quotas.md)
    shares: Mapped[dict[str, float]] = mapped_column(JSON, default=dict, server_default="{}")
    # the jurisdictions the key's requests may be processed in (ApiKeyRecord.residency); None: any
    residency: Mapped[list[str] | None] = mapped_column(JSON, nullable=True, default=None)
    # the team its usage is charged to (cost reports, budgets); None: no team
    team: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    # the webhook signing secret's version (ApiKeyRecord.webhook_secret_version); the secret
    # is derived from the fleet's webhook master, never stored
    webhook_secret_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class UsageRecord(Base):
    """One finished gateway request (`fleet_base.protocol.UsageRecord` from fleet.v1.usage.*)."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_deployment_at", "deployment", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(index=True)
    cluster: Mapped[str] = mapped_column(String(63), index=True)
    key_id: Mapped[str] = mapped_column(String(32), index=True)
    deployment: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[int] = mapped_column(Integer, default=200)
    latency_s: Mapped[float] = mapped_column(Float, default=0.0)
    # time to the first token (prefill, for cost per phase); None: not streamed or not said
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    adapter: Mapped[str | None] = mapped_column(String(63), nullable=True)  # LoRA adapter, if any
    # where the request was processed, as the gateway reported it
    region: Mapped[str] = mapped_column(String(64), default="", server_default="")
    jurisdiction: Mapped[str] = mapped_column(String(64), default="", server_default="")
    # the gateway's id of the record (or the stream sequence): a redelivery is stored once
    record_id: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)
    # a shadow copy (a rollout's shadow phase): shown as shadow usage, never charged to the
    # key, never counted in its quotas or budget, nor as autoscaling demand
    shadow: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false(), index=True)
    shadow_of: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the original's record_id
    itl_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    greedy_match: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    first_diff_token: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # a hop of a pipeline request: the pipeline, its step, and the id tying its hops together
    pipeline: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    pipeline_step: Mapped[str | None] = mapped_column(String(63), nullable=True)
    pipeline_request: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    # a batch line or async request: charged as any request, listed apart in usage
    batch: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Event(Base):
    """Something that happened in the fleet (replica ready, cluster unhealthy, scaled...)."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    cluster: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    deployment: Mapped[str | None] = mapped_column(String(63), nullable=True, index=True)
    replica_id: Mapped[str | None] = mapped_column(String(63), nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    # the agent's id of the event: a redelivery is stored once (None: written here)
    event_id: Mapped[str | None] = mapped_column(String(64), nullable=True, unique=True)


class AuditRecord(Base):
    """Who changed what through the admin API, with the resource before and after."""

    __tablename__ = "audit_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    resource_type: Mapped[str] = mapped_column(String(32), index=True)
    resource_id: Mapped[str] = mapped_column(String(128))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Rollout(Base):
    """A canary rollout of one deployment: the policy's persisted state
    (`control_plane.rollouts.policy.RolloutState`), so a restart resumes it. `revision`
    grows with every write; writers update only the revision they read."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    baseline_version: Mapped[int] = mapped_column(Integer)
    canary_version: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16), default="deploying", index=True)
    step: Mapped[int] = mapped_column(Integer, default=0)
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)  # RolloutParams
    phase_started_at: Mapped[float] = mapped_column(Float, default=0.0)  # Unix seconds
    window_started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    last: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the last decision's numbers
    revision: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(nullable=True)
    # The shadow phase (control_plane.rollouts.shadow): share and duration asked for (None:
    # none), "running" | "passed" | "stopped", why, and the last comparison of copies.
    shadow_share: Mapped[float | None] = mapped_column(Float, nullable=True)
    shadow_duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    shadow_phase: Mapped[str | None] = mapped_column(String(16), nullable=True)
    shadow_reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    shadow_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    deployment: Mapped[Deployment] = relationship()


class ReplicaInterval(Base):
    """One replica's lifetime on a pool: the cost ledger. Price and tier are copied from
    the pool when the replica starts, so a later price edit or the replica's (or pool's)
    deletion never rewrites what was paid. `ended_at` is None while it runs."""

    __tablename__ = "replica_intervals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    replica_id: Mapped[str] = mapped_column(String(63), index=True)
    deployment: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[int] = mapped_column(Integer)
    cluster: Mapped[str] = mapped_column(String(63), index=True)
    pool: Mapped[str] = mapped_column(String(63))
    tier: Mapped[str] = mapped_column(String(16))  # fleet_base.domain.Tier
    gpus: Mapped[int] = mapped_column(Integer)
    hourly_price: Mapped[float] = mapped_column(Float)  # per GPU-hour, as CapacityPool.hourly_price
    started_at: Mapped[datetime] = mapped_column(index=True)
    ended_at: Mapped[datetime | None] = mapped_column(nullable=True, index=True)
    end_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)


class TeamBudget(Base):
    """A team's monthly dollar budget: the fractions to alert at, whether it is hard (keys
    refused once spent), and which thresholds were already alerted this month."""

    __tablename__ = "team_budgets"

    team: Mapped[str] = mapped_column(String(63), primary_key=True)
    monthly_dollars: Mapped[float] = mapped_column(Float)
    thresholds: Mapped[list[float]] = mapped_column(JSON, default=lambda: [0.5, 0.8, 1.0])
    hard: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # {"month": "2026-12", "thresholds": [0.5, ...]}: alerts already sent
    alerted: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Node(Base):
    """A node where replicas run (the host, or a Kubernetes node), as its agent last
    reported it (`fleet_base.node_health.NodeHealth`), and the operator's latest word on it
    (`action*`: cordon or uncordon, published to the agent in its DesiredState)."""

    __tablename__ = "nodes"
    __table_args__ = (UniqueConstraint("cluster", "node", name="uq_nodes_cluster_node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster: Mapped[str] = mapped_column(String(63), index=True)
    node: Mapped[str] = mapped_column(String(253))
    state: Mapped[str] = mapped_column(String(16), default="healthy", index=True)  # NodeState
    reason: Mapped[str] = mapped_column(Text, default="")
    since: Mapped[datetime] = mapped_column(default=utcnow)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpus_withheld: Mapped[list[int]] = mapped_column(JSON, default=list)
    cordoned_by: Mapped[str] = mapped_column(String(16), default="")
    faults: Mapped[int] = mapped_column(Integer, default=0)  # the agent's count since it started
    nvml: Mapped[str] = mapped_column(Text, default="")
    # the pool its capacity belongs to, when known (a fault's replica said so, or the cluster has one)
    pool: Mapped[str] = mapped_column(String(63), default="")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    action: Mapped[str | None] = mapped_column(String(16), nullable=True)  # cordon | uncordon
    action_at: Mapped[datetime | None] = mapped_column(nullable=True)
    action_reason: Mapped[str] = mapped_column(Text, default="")
    action_by: Mapped[str] = mapped_column(String(200), default="")


class NodeFaultRecord(Base):
    """One fault an agent observed (`fleet_base.node_health.NodeFault`), stored once by
    `fault_id`: the record failure rates and `fleetctl nodes show` read. Kept (readers
    bound their window); `pool` and `provider` are resolved when it is stored, so a
    later move or deletion never rewrites where it happened."""

    __tablename__ = "node_faults"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    fault_id: Mapped[str] = mapped_column(String(64), unique=True)
    cluster: Mapped[str] = mapped_column(String(63), index=True)
    node: Mapped[str] = mapped_column(String(253), index=True)
    gpu: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)  # FaultKind
    at: Mapped[datetime] = mapped_column(index=True)
    evidence: Mapped[str] = mapped_column(Text, default="")
    replica_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    deployment: Mapped[str | None] = mapped_column(String(128), nullable=True)
    pool: Mapped[str] = mapped_column(String(63), default="")
    provider: Mapped[str] = mapped_column(String(63), default="")
    # counts against the node (fleet_base.node_health.is_node_fault): not an out-of-memory
    # nor an application XID, which are recorded only
    node_fault: Mapped[bool] = mapped_column(Boolean, default=True)


class ControlPlaneLease(Base):
    """One leader lease per name ('control-plane'): `holder` None when free or released;
    `epoch` moves on every acquire (the fencing token the loops' commits are checked
    against); `version` on every acquire and renew (the change followers time on their own
    clocks). `renewed_at` is informational only: no decision compares wall clocks."""

    __tablename__ = "control_plane_lease"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(200), nullable=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    version: Mapped[int] = mapped_column(Integer, default=0)
    lease_s: Mapped[float] = mapped_column(Float)
    renewed_at: Mapped[datetime] = mapped_column(default=utcnow)


class ControlPlaneMember(Base):
    """A control-plane process (any role), heartbeating its row every retry period."""

    __tablename__ = "control_plane_members"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    url: Mapped[str] = mapped_column(String(500), default="")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow, index=True)


__all__ = [
    "ApiKey",
    "AuditRecord",
    "Base",
    "CapacityPool",
    "Cluster",
    "ControlPlaneLease",
    "ControlPlaneMember",
    "Deployment",
    "DeploymentVersion",
    "Event",
    "Node",
    "NodeFaultRecord",
    "Pipeline",
    "ReplicaAssignment",
    "ReplicaInterval",
    "Rollout",
    "TeamBudget",
    "utcnow",
]


class AutoscalerState(Base):
    """One deployment's autoscaler memory (`control_plane.autoscale.snapshot`, JSON), as
    the leader last stored it: a new leader resumes from it."""

    __tablename__ = "autoscaler_states"

    deployment_id: Mapped[int] = mapped_column(
        ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    policy: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(Text)  # all but the cycles
    cycles: Mapped[str | None] = mapped_column(Text, nullable=True)  # the daily and weekly cycles
    at: Mapped[float] = mapped_column(Float)  # Unix seconds: its last observation
    saved_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Pipeline(Base):
    """Deployments that serve one request together (`fleet_base.pipelines.PipelineSpec`):
    `steps` in call order as [{name, deployment}], by deployment name so a step is plain
    data the placer, the routing table and the simulator read alike. A deployment in a
    pipeline cannot be deleted (the API answers 409) until the pipeline is."""

    __tablename__ = "pipelines"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), unique=True, index=True)
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    slo_e2e_s: Mapped[float | None] = mapped_column(Float, nullable=True, default=None)  # None: no budget
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
