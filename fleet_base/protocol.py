"""Fleet's wire contract: every message that crosses NATS between the control plane,
agents and gateways.

JSON on the wire, one Pydantic model per message, each carrying `schema_version`.
Readers ignore unknown fields so a newer writer does not break an older reader; a
reader that sees a newer *major* schema logs and skips the message instead of guessing.
Nothing here does I/O: `fleet_base.nats_io` moves these models over NATS, and `fleet_base.wire`
has the one decode per message kind (bounds, schema version, subject/identity checks).
API key records live in `fleet_base.api_keys`, prefix-cache events in `fleet_base.kv_events`,
and the names and pool shape the messages carry in `fleet_base.domain`.
"""

from __future__ import annotations

import secrets
import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from fleet_base.bounds import MAX_TOKENS, Count, FiniteFloat, Timestamp, TokenCount
from fleet_base.domain import AdapterName, Coordinates, PoolShape
from fleet_base.engines import EngineKind
from fleet_base.node_health import MAX_FAULTS, MAX_NODES, NodeAction, NodeFault, NodeHealth
from fleet_base.pipelines import PipelineSpec, PipelineStep

# Bounds of what an agent or gateway may report (fleet_base.domain bounds each pool).
MAX_POOLS = 256
MAX_REPLICAS = 10_000
# Tokens of one request's usage record: a context window's worth (fleet_base.bounds), so a
# forged record cannot bill a key for more than one request could use.
MAX_USAGE_TOKENS = MAX_TOKENS
MAX_TEXT = 4096
MAX_PROMPT_SAMPLE = 64  # prompt lengths one replica's load may carry

SCHEMA_VERSION = 1

# The control-plane leader's fencing epoch a KV value was written under (control_plane.ha):
# agents refuse a value whose epoch is lower than the highest they have seen in its bucket,
# so a paused old leader that wakes up cannot undo its successor's decisions. 0: written
# by no elected leader (legacy writers; a missing field reads as 0).
Epoch = Annotated[int, Field(ge=0, le=2**62)]

ShortText = Annotated[str, Field(max_length=64)]

# JetStream key-value buckets.
BUCKET_DESIRED = "fleet_desired"  # key = cluster id -> DesiredState
BUCKET_ROUTES = "fleet_routes"  # key = deployment name -> RoutingTable
BUCKET_KEYS = "fleet_keys"  # key = api key id -> ApiKeyRecord
BUCKETS = (BUCKET_DESIRED, BUCKET_ROUTES, BUCKET_KEYS)

# Subjects (the trailing token is the cluster id).
SUBJECT_PREFIX = "fleet.v1"
STREAM_EVENTS = "FLEET_EVENTS"
STREAM_USAGE = "FLEET_USAGE"


def heartbeat_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.heartbeat.{cluster}"


def events_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.events.{cluster}"


def usage_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.usage.{cluster}"


def models_subject(cluster: str) -> str:
    """Requests to a cluster's agent about its model cache (ModelCommand -> ModelCommandReply)."""
    return f"{SUBJECT_PREFIX}.models.{cluster}"


def demand_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.demand.{cluster}"


HEARTBEAT_WILDCARD = f"{SUBJECT_PREFIX}.heartbeat.*"
DEMAND_WILDCARD = f"{SUBJECT_PREFIX}.demand.*"
EVENTS_WILDCARD = f"{SUBJECT_PREFIX}.events.*"
USAGE_WILDCARD = f"{SUBJECT_PREFIX}.usage.*"
# Control-plane instances only (no cluster identity may use it): an API write on a follower
# wakes the leader's loops (ControlPlaneKick).
CONTROL_PLANE_KICK_SUBJECT = f"{SUBJECT_PREFIX}.control-plane.kick"


class Message(BaseModel):
    """Base of every wire message."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes | str):
        return cls.model_validate_json(data)


class ControlPlaneKick(Message):
    """A follower's API changed desired state: the leader reconciles now."""

    member: str = Field("", max_length=200)


class ReplicaState(str, Enum):
    pending = "pending"  # wanted, not started yet
    starting = "starting"
    ready = "ready"
    draining = "draining"
    failed = "failed"
    stopped = "stopped"


class Resources(BaseModel):
    """What one replica needs. `gpu_models` empty means any accelerator (or CPU slots)."""

    gpu_models: list[str] = Field(default_factory=list)
    gpu_count: int = Field(1, ge=1, le=64)
    gpu_memory_gb: float = Field(0.0, ge=0)


class PoolInventory(PoolShape):
    """A capacity pool a cluster offers, as its agent reports it."""

    name: str  # widths are checked by the control plane's ingest (a reason, not a parse error)


# --------------------------------------------------------------------- desired state


MAX_ADAPTERS = 256
DEFAULT_MAX_ADAPTERS = 4  # adapters per replica of a deployment that names adapters but no room


class LoRAAdapterSpec(BaseModel):
    """A LoRA adapter of a deployment: the name clients send as `model`, and where its
    PEFT files are (a model URI, as for base models, or a local directory)."""

    name: AdapterName
    uri: str = Field(min_length=1, max_length=512)


class ReplicaSpec(BaseModel):
    """One replica the control plane wants on a cluster. A changed `version` (or spec)
    under the same deployment means "replace", and a new replica_id is issued for it;
    except `adapters`, which agents apply to running replicas (load/unload, no restart)."""

    replica_id: str
    deployment: str
    version: int
    model: str
    # Which server runs the replica (fleet_base.engines): its launch command, health path,
    # metrics names and what the gateway may ask of it.
    engine: EngineKind = "fleet"
    engine_args: dict[str, Any] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    pool: str = ""
    # Multi-LoRA: the deployment's adapter catalog and how many one replica holds at once
    # (0 = LoRA off). Agents preload a spread; gateways load on demand where there is room.
    adapters: list[LoRAAdapterSpec] = Field(default_factory=list, max_length=MAX_ADAPTERS)
    max_adapters: int = Field(0, ge=0, le=64)


class DesiredState(Message):
    """Everything one cluster should run; the whole set, never a delta."""

    cluster: str
    generation: int = 0
    replicas: list[ReplicaSpec] = Field(default_factory=list)
    updated_at: float = Field(default_factory=time.time)
    # The cluster's own jurisdiction (fleet_base.residency): its gateway refuses keys whose
    # residency excludes it. "" = none, which is outside every residency policy.
    jurisdiction: str = ""
    # Operators' cordons and uncordons of this cluster's nodes (fleet_base.node_health),
    # the latest per node.
    node_actions: list[NodeAction] = Field(default_factory=list, max_length=MAX_NODES)
    epoch: Epoch = 0


# --------------------------------------------------------------------- routes


class VersionWeight(BaseModel):
    version: int
    weight: float = Field(1.0, ge=0)


class ClusterRoute(BaseModel):
    """A cluster serving a deployment, and where its gateway listens (for spillover)."""

    cluster: str
    region: str = ""
    gateway_url: str = ""
    coordinates: Coordinates = Field(default_factory=Coordinates)
    replicas: int = 0
    healthy: bool = True
    provider: str = ""
    # Set in RoutingTable.by_region lists: expected RTT from that client region, and the
    # cluster's share of the deployment's ready replicas (its capacity for spillover).
    rtt_ms: float | None = None
    weight: float = 0.0
    # Active-passive: a warm standby takes traffic only while no primary
    # cluster of the deployment is alive.
    standby: bool = False
    # The cluster's jurisdiction (fleet_base.residency); "" is outside every policy.
    jurisdiction: str = ""


class ShadowTarget(BaseModel):
    """A version that receives copies of a share of a deployment's requests (a rollout's
    shadow phase): users never see its answers, and it gets weight 0 in `versions`."""

    version: int = Field(ge=0, le=2**31 - 1)
    share: float = Field(gt=0, le=1, allow_inf_nan=False)


MAX_ROUTE_PIPELINES = 64


def _known_fields(value: Any, model: type[BaseModel]) -> Any:
    return {k: v for k, v in value.items() if k in model.model_fields} if isinstance(value, dict) else value


def tolerant_pipelines(value: Any) -> Any:
    """Pipelines as this reader understands them: a newer writer's unknown fields dropped
    (`PipelineSpec` forbids them, for the API), and an entry that still does not parse left
    out, so one pipeline this reader cannot read never costs the deployment its route."""
    if not isinstance(value, list):
        return value
    out: list[PipelineSpec] = []
    for item in value[:MAX_ROUTE_PIPELINES]:
        if isinstance(item, dict):
            item = _known_fields(item, PipelineSpec)
            steps = item.get("steps")
            if isinstance(steps, list):
                item = {**item, "steps": [_known_fields(s, PipelineStep) for s in steps]}
        try:
            out.append(PipelineSpec.model_validate(item))
        except ValidationError:
            continue
    return out


class RoutingTable(Message):
    deployment: str
    versions: list[VersionWeight] = Field(default_factory=list)
    clusters: list[ClusterRoute] = Field(default_factory=list)
    # Client region -> clusters in order of expected latency (control_plane.geo.routes).
    by_region: dict[str, list[ClusterRoute]] = Field(default_factory=dict)
    # The deployment may have zero replicas (min_replicas 0): gateways hold its requests
    # for a cold start (`gateway.cold_start_timeout_s`) and signal demand.
    scale_to_zero: bool = False
    generation: int = 0
    updated_at: float = Field(default_factory=time.time)
    # The deployment's residency policy: the jurisdictions its requests may be processed in
    # (None: no policy). Gateways intersect it with the key's (fleet_base.residency.allowed).
    residency: list[str] | None = None
    # While set, gateways copy `share` of the deployment's requests to replicas of
    # `version` (a rollout's shadow phase) and report the copies as shadow usage.
    shadow: ShadowTarget | None = None
    epoch: Epoch = 0
    # The pipelines the deployment is a step of (`fleet_base.pipelines`): gateways keep a
    # pipeline's hops in one cluster and send a new pipeline request whole to a cluster
    # where every step is ready.
    pipelines: Annotated[list[PipelineSpec], BeforeValidator(tolerant_pipelines)] = Field(
        default_factory=list, max_length=MAX_ROUTE_PIPELINES
    )


# --------------------------------------------------------------------- heartbeats


class ReplicaLoad(BaseModel):
    running: Count = 0
    waiting: Count = 0
    kv_cache_usage: FiniteFloat = 0.0
    tokens_per_s: FiniteFloat = 0.0  # generated
    # Work for the SLO-driven autoscaler: admitted prompt tokens/s, first tokens/s (requests
    # starting), and the mean TTFT of those requests (None: none in the window).
    prompt_tokens_per_s: FiniteFloat = 0.0
    requests_per_s: FiniteFloat = 0.0
    ttft_s: FiniteFloat | None = None
    # Prompt lengths spread like those of the requests that started (from the engine's
    # prompt-length histogram): the mix of the work, which the rates do not carry.
    prompt_sample: tuple[TokenCount, ...] = Field(default=(), max_length=MAX_PROMPT_SAMPLE)


class ReplicaStatus(BaseModel):
    replica_id: str
    deployment: str
    version: int
    state: ReplicaState
    url: str = ""
    pool: str = ""
    pid: int | None = None  # process runtime only: lets `fleetctl ps/down` see replicas
    restarts: int = 0
    started_at: float | None = None
    last_error: str = ""
    load: ReplicaLoad = Field(default_factory=ReplicaLoad)
    # Seconds from the agent starting this replica to its first ready /health.
    cold_start_s: float | None = None
    # The cluster cannot schedule it (runtime kubernetes: pod Pending, Unschedulable).
    unschedulable: bool = False
    # The cold start in parts: waiting for the model in the node cache (0 when cached),
    # loading it, the warm-up token, and the first request's time to first token.
    pull_s: float | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    first_token_s: float | None = None
    # LoRA adapters loaded on the replica now (its /v1/models), its room for them, and the
    # deployment's catalog (name -> uri) so the gateway can load one where there is room.
    adapters: list[str] = Field(default_factory=list, max_length=MAX_ADAPTERS)
    max_adapters: int = Field(0, ge=0, le=64)
    adapter_uris: dict[str, str] = Field(default_factory=dict, max_length=MAX_ADAPTERS)
    # The server that runs it (fleet_base.engines): what the gateway may ask of it.
    engine: EngineKind = "fleet"
    # What the runtime says of how it runs, e.g. a foreign engine served without TLS.
    note: str = Field("", max_length=512)


class CachedModel(BaseModel):
    """A model in (or on its way into) a cluster's node cache, as its agent reports it."""

    uri: str
    state: Literal["pulling", "ready", "failed"] = "ready"
    pinned_uri: str = ""
    size_bytes: int = 0
    bytes_done: int = 0
    files: int = 0
    in_use: bool = False
    last_used: float | None = None
    pull_s: float | None = None
    error: str = ""


class ModelCommand(Message):
    """`fleetctl models pull|rm` for one cluster, sent by the control plane (request/reply)."""

    action: Literal["pull", "rm"]
    uri: str = Field(min_length=1, max_length=512)


class ModelCommandReply(Message):
    ok: bool
    message: str = ""


class Heartbeat(Message):
    """Every second from each agent: inventory, replicas and load. The first one also
    registers the cluster with the control plane."""

    cluster: str
    provider: str = "local"
    region: str = ""
    coordinates: Coordinates = Field(default_factory=Coordinates)
    gateway_url: str = ""
    pools: list[PoolInventory] = Field(default_factory=list, max_length=MAX_POOLS)
    replicas: list[ReplicaStatus] = Field(default_factory=list, max_length=MAX_REPLICAS)
    desired_generation: int = Field(-1, ge=-1, le=2**62)  # last DesiredState generation applied
    # The highest control-plane epoch the agent accepted in any bucket (agent.fencing): a
    # leader whose epoch is lower learns that its database lost history, or that it is deposed.
    fence_epoch: Epoch = 0
    queue_depth: Count = 0
    tokens_per_s: FiniteFloat = 0.0
    # Replicas whose spot node the provider reclaimed: re-placed at once (elsewhere).
    preempted: list[str] = Field(default_factory=list, max_length=MAX_REPLICAS)
    # Replicas the cluster cannot schedule (capacity its pool claimed is missing; the pool
    # is reported smaller meanwhile): re-placed at once, like preempted ones.
    unschedulable: list[str] = Field(default_factory=list, max_length=MAX_REPLICAS)
    # The node's model cache: what is cached or being pulled (`fleetctl models ls`).
    models: list[CachedModel] = Field(default_factory=list, max_length=MAX_REPLICAS)
    # State files the agent cannot write now (a full disk), with why, and the failed
    # writes since it started: its gateway may be serving from stale keys and routes.
    state_writes_failing: dict[ShortText, ShortText] = Field(default_factory=dict, max_length=16)
    state_write_failures: Count = 0
    # Each node's health as the agent holds it, and the faults it observed lately (each
    # repeated for a while; the control plane stores each `fault_id` once).
    nodes: list[NodeHealth] = Field(default_factory=list, max_length=MAX_NODES)
    node_faults: list[NodeFault] = Field(default_factory=list, max_length=MAX_FAULTS)
    sent_at: Timestamp = Field(default_factory=time.time)


# --------------------------------------------------------------------- events and usage


EventKind = Literal[
    "replica_starting",
    "replica_ready",
    "replica_failed",
    "replica_restarted",
    "replica_stopped",
    "replica_preempted",
    "replica_unschedulable",
    "node_fault",
    "node_state",
    "cluster_healthy",
    "cluster_unhealthy",
    "scaled",
    "placed",
    "info",
]


class Event(Message):
    cluster: str
    kind: EventKind
    message: str = Field("", max_length=MAX_TEXT)
    deployment: str | None = None
    replica_id: str | None = None
    at: Timestamp = Field(default_factory=time.time)
    # Unique per event (the writer's), so a redelivered message is stored once.
    event_id: str | None = Field(default_factory=lambda: secrets.token_hex(12), max_length=64)


class UsageRecord(Message):
    """One finished gateway request, for accounting and quotas."""

    cluster: str
    key_id: str
    deployment: str
    version: int | None = Field(None, ge=0, le=2**31 - 1)
    prompt_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    completion_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    status: int = Field(200, ge=100, le=599)
    ttft_s: FiniteFloat | None = None
    latency_s: FiniteFloat = 0.0
    at: Timestamp = Field(default_factory=time.time)
    # a request a quota refused (status 429): the tokens it asked for, which the control
    # plane counts as demand when it splits the key's budget between regions
    refused_tokens: int = Field(0, ge=0, le=MAX_USAGE_TOKENS)
    # Unique per record (the gateway's), so a redelivered message is counted once.
    record_id: str | None = Field(default_factory=lambda: secrets.token_hex(12), max_length=64)
    # A replica attempt that failed before the first byte and was retried elsewhere: not a
    # finished request (no tokens; accounting skips it), but the canary guards count it
    # against the version that failed.
    attempt_failed: bool = False
    # The LoRA adapter the request named (None: the base model).
    adapter: AdapterName | None = None
    # Where the request was processed: the serving cluster's region and jurisdiction.
    region: str = Field("", max_length=64)
    jurisdiction: str = Field("", max_length=64)
    # A shadow copy (RoutingTable.shadow): stored and shown as shadow usage, never charged to
    # the key, never counted against its quotas or budget, nor as autoscaling demand.
    shadow: bool = False
    # On a copy: the original request's `record_id`, so the two can be compared.
    shadow_of: str | None = Field(None, max_length=64)
    # Mean inter-token latency of a stream (originals and copies).
    itl_s: FiniteFloat | None = None
    # On a copy of a greedy request (temperature 0 / top_k 1): whether its output tokens
    # equal the original's, and the index of the first that differs; None when the request
    # is not greedy or the two are not comparable.
    greedy_match: bool | None = None
    first_diff_token: int | None = Field(None, ge=0, le=MAX_USAGE_TOKENS)
    # A hop of a pipeline request (`fleet_base.pipelines`): the pipeline, the step it
    # called and the id tying its hops together; `cluster` says where it was served.
    pipeline: str | None = Field(None, max_length=63)
    pipeline_step: str | None = Field(None, max_length=63)
    pipeline_request: str | None = Field(None, max_length=128)
    # A batch line or async request (`fleet_base.batch`): charged as any request, listed
    # apart; its `record_id` is derived from the line, so a re-run is booked once.
    batch: bool = False


class Demand(Message):
    """A gateway's requests waiting for replicas of one deployment, on
    `fleet.v1.demand.<cluster>`: sent when a request queues and at most every
    `DEMAND_EVERY_S` while any wait. `ready` = 0 asks the autoscaler to scale from zero.
    `batch_backlog` is the deployment's batch and async work queue as this gateway read it:
    one queue shared by every cluster, so the control plane counts it once, not per report."""

    cluster: str
    deployment: str
    queued: Count = 0
    ready: Count = 0
    batch_backlog: Count = 0
    at: Timestamp = Field(default_factory=time.time)
