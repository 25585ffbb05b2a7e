"""Fleet's wire contract: every message that crosses NATS between the control plane,
agents and gateways.

JSON on the wire, one Pydantic model per message, each carrying `schema_version`.
Readers ignore unknown fields so a newer writer does not break an older reader; a
reader that sees a newer *major* schema logs and skips the message instead of guessing.
Nothing here does I/O: `fleet_base.nats_io` moves these models over NATS, and `fleet_base.wire`
has the one decode per message kind (bounds, schema version, subject/identity checks).

Longer than ~400 lines on purpose: the contract is read as one page, every message beside
the subjects and buckets it travels on.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet_base.bounds import FiniteFloat, Timestamp

# Bounds of what an agent or gateway may report (the admin API's pool limits, for one):
# a heartbeat cannot make the control plane allocate per node beyond these.
MAX_POOL_NODES = 100_000
MAX_GPUS_PER_NODE = 64
MAX_POOLS = 256
MAX_REPLICAS = 10_000
MAX_COUNT = 1 << 30
MAX_USAGE_TOKENS = 2**31 - 1
MAX_TEXT = 4096

SCHEMA_VERSION = 1

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


def kvcache_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.kvcache.{cluster}"


def demand_subject(cluster: str) -> str:
    return f"{SUBJECT_PREFIX}.demand.{cluster}"


HEARTBEAT_WILDCARD = f"{SUBJECT_PREFIX}.heartbeat.*"
DEMAND_WILDCARD = f"{SUBJECT_PREFIX}.demand.*"
EVENTS_WILDCARD = f"{SUBJECT_PREFIX}.events.*"
USAGE_WILDCARD = f"{SUBJECT_PREFIX}.usage.*"
KVCACHE_WILDCARD = f"{SUBJECT_PREFIX}.kvcache.*"


def kvresync_subject(cluster: str) -> str:
    """Where a gateway asks a cluster's agent for a replica's full prefix-cache set."""
    return f"{SUBJECT_PREFIX}.kvresync.{cluster}"


class Message(BaseModel):
    """Base of every wire message."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes | str):
        return cls.model_validate_json(data)


class Tier(str, Enum):
    """Procurement tier of a capacity pool, cheapest-to-lose last."""

    reserved = "reserved"
    on_demand = "on-demand"
    spot = "spot"


TIER_ORDER = {Tier.reserved: 0, Tier.on_demand: 1, Tier.spot: 2}


class ClusterStatus(str, Enum):
    healthy = "healthy"
    unhealthy = "unhealthy"
    draining = "draining"  # operator cordon: keep serving, place nothing new


class ReplicaState(str, Enum):
    pending = "pending"  # wanted, not started yet
    starting = "starting"
    ready = "ready"
    draining = "draining"
    failed = "failed"
    stopped = "stopped"


class Coordinates(BaseModel):
    lat: float = Field(0.0, ge=-90, le=90)
    lon: float = Field(0.0, ge=-180, le=180)


class Resources(BaseModel):
    """What one replica needs. `gpu_models` empty means any accelerator (or CPU slots)."""

    gpu_models: list[str] = Field(default_factory=list)
    gpu_count: int = Field(1, ge=1, le=64)
    gpu_memory_gb: float = Field(0.0, ge=0)


class PoolInventory(BaseModel):
    """A capacity pool a cluster offers. On a CPU machine `gpu_model` is "cpu" and the
    "GPUs" are replica slots, so the same placement flow runs without accelerators."""

    name: str  # widths are checked by the control plane's ingest (a reason, not a parse error)
    gpu_model: str
    gpu_memory_gb: float = Field(0.0, ge=0, le=100_000, allow_inf_nan=False)
    gpus_per_node: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)
    nodes: int = Field(1, ge=0, le=MAX_POOL_NODES)
    tier: Tier = Tier.on_demand
    hourly_price: float = Field(0.0, ge=0, le=1_000_000, allow_inf_nan=False)


# --------------------------------------------------------------------- desired state


MAX_ADAPTERS = 256
DEFAULT_MAX_ADAPTERS = 4  # adapters per replica of a deployment that names adapters but no room
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class LoRAAdapterSpec(BaseModel):
    """A LoRA adapter of a deployment: the name clients send as `model`, and where its
    PEFT files are (a model URI, as for base models, or a local directory)."""

    name: str = Field(pattern=ADAPTER_NAME)
    uri: str = Field(min_length=1, max_length=512)


class ReplicaSpec(BaseModel):
    """One replica the control plane wants on a cluster. A changed `version` (or spec)
    under the same deployment means "replace", and a new replica_id is issued for it;
    except `adapters`, which agents apply to running replicas (load/unload, no restart)."""

    replica_id: str
    deployment: str
    version: int
    model: str
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


# --------------------------------------------------------------------- API keys


class DeploymentLimits(BaseModel):
    """A key's limits on one deployment, on top of its overall limits (None: unlimited)."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_minute: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)


class Quotas(BaseModel):
    """Per-key limits; None means unlimited. Enforced by gateways (docs/quotas.md)."""

    tokens_per_minute: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-10, le=10)
    tokens_per_day: int | None = Field(None, ge=1)
    # deployment name -> limits on that deployment alone
    deployments: dict[str, DeploymentLimits] = Field(default_factory=dict)
    # the gateway's queueing class (e.g. "interactive" over "batch"); None: its default class
    priority_class: str | None = Field(None, pattern=r"^[a-z][a-z0-9_-]{0,31}$")

    def limited(self) -> bool:
        """Whether any token or request rate applies (gateways then send x-ratelimit-* headers)."""
        own = (self.tokens_per_minute, self.requests_per_minute, self.tokens_per_day)
        per = [
            v
            for d in self.deployments.values()
            for v in (d.tokens_per_minute, d.requests_per_minute, d.tokens_per_day)
        ]
        return any(v is not None for v in (*own, *per))


class ApiKeyRecord(Message):
    """An inference or admin key as gateways see it: the salted hash, never the secret."""

    key_id: str
    name: str
    salt: str
    hash: str
    scopes: list[str] = Field(default_factory=lambda: ["inference"])
    deployments: list[str] | None = None  # None: every deployment
    quotas: Quotas = Field(default_factory=Quotas)
    # cluster id -> this cluster's fraction of the key's token budgets, set by the control
    # plane from recent usage; empty: every gateway enforces the whole budget (docs/quotas.md)
    shares: dict[str, float] = Field(default_factory=dict)
    revoked: bool = False
    created_at: float = Field(default_factory=time.time)

    def allows(self, deployment: str) -> bool:
        return self.deployments is None or deployment in self.deployments


# A reserved entry of `fleet_keys` (key ids are hex, so it never collides): the control
# plane renews it every few seconds whether or not a key changed, so an agent and its
# gateway can tell a current key set from one that stopped being updated.
KEYS_LEASE = "_lease"


class KeyLease(Message):
    """The key set's lease: valid for `valid_s` from `issued_at` (the issuer's clock)."""

    issued_at: float = Field(default_factory=time.time)
    valid_s: float = Field(15.0, gt=0)
    keys: int = Field(0, ge=0)  # live keys in the set when issued


KEY_PREFIX = "fleet"


def new_secret(key_id: str | None = None) -> tuple[str, str]:
    """A new (key_id, secret). The secret embeds the id ("fleet-<id>-<random>") so a
    verifier finds the record in O(1) before checking the salted hash."""
    key_id = key_id or secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(24)}"


def key_id_of(secret: str) -> str | None:
    parts = secret.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1]:
        return None
    return parts[1]


def hash_secret(secret: str, salt: str | None = None) -> tuple[str, str]:
    """(salt, hex digest). Keys are 192-bit random, so a keyed SHA-256 suffices; a slow
    KDF would only cost every gateway request."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()
    return salt, digest


def verify_secret(secret: str, salt: str, digest: str) -> bool:
    return hmac.compare_digest(hash_secret(secret, salt)[1], digest)


# --------------------------------------------------------------------- heartbeats


class ReplicaLoad(BaseModel):
    running: int = Field(0, ge=0, le=MAX_COUNT)
    waiting: int = Field(0, ge=0, le=MAX_COUNT)
    kv_cache_usage: FiniteFloat = 0.0
    tokens_per_s: FiniteFloat = 0.0  # generated
    # Work for the SLO-driven autoscaler: admitted prompt tokens/s, first tokens/s (requests
    # starting), and the mean TTFT of those requests (None: none in the window).
    prompt_tokens_per_s: FiniteFloat = 0.0
    requests_per_s: FiniteFloat = 0.0
    ttft_s: FiniteFloat | None = None


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
    queue_depth: int = Field(0, ge=0, le=MAX_COUNT)
    tokens_per_s: FiniteFloat = 0.0
    # Replicas whose spot node the provider reclaimed: re-placed at once (elsewhere).
    preempted: list[str] = Field(default_factory=list, max_length=MAX_REPLICAS)
    # Replicas the cluster cannot schedule (capacity its pool claimed is missing; the pool
    # is reported smaller meanwhile): re-placed at once, like preempted ones.
    unschedulable: list[str] = Field(default_factory=list, max_length=MAX_REPLICAS)
    # The node's model cache: what is cached or being pulled (`fleetctl models ls`).
    models: list[CachedModel] = Field(default_factory=list, max_length=MAX_REPLICAS)
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
    adapter: str | None = Field(None, pattern=ADAPTER_NAME)


class Demand(Message):
    """A gateway's requests waiting for replicas of one deployment, on
    `fleet.v1.demand.<cluster>`: sent when a request queues and at most every
    `DEMAND_EVERY_S` while any wait. `ready` = 0 asks the autoscaler to scale from zero."""

    cluster: str
    deployment: str
    queued: int = Field(0, ge=0)
    ready: int = Field(0, ge=0)
    at: float = Field(default_factory=time.time)


# --------------------------------------------------------------------- prefix caches


class KvCacheOp(BaseModel):
    """Blocks that became cached (full and hashed), were evicted, or the whole cache was
    dropped, in the engine's chained sha256 scheme (hex)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[str] = Field(default_factory=list, max_length=65536)

    @field_validator("block_hashes")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for h in v:
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError("a block hash is 64 lower-case hex digits")
        return v


class KvCacheBatch(Message):
    """One batch of a replica's prefix-cache changes, on `fleet.v1.kvcache.<cluster>`.

    `seq` is consecutive within `epoch` (a new epoch when the replica or the agent's relay
    restarts); `snapshot` batches carry the replica's full set and replace what a reader
    knew. A reader that sees a gap asks for a snapshot on `fleet.v1.kvresync.<cluster>`.
    Hashes are rooted in the request's cache salt, so a salted (per-tenant) block only
    matches requests under the same salt; the salt itself never travels."""

    cluster: str
    deployment: str
    replica_id: str
    epoch: str = Field(min_length=1, max_length=128)
    seq: int = Field(ge=0)
    snapshot: bool = False
    block_size: int = Field(16, ge=1)
    ops: list[KvCacheOp] = Field(default_factory=list, max_length=1024)
    at: float = Field(default_factory=time.time)


ALL_REPLICAS = "*"


class KvResyncRequest(Message):
    """A gateway lost track of a replica's prefix cache (or, `replica_id` "*", of every
    replica of the cluster: it just connected): send the full set again."""

    cluster: str
    replica_id: str
    requester: str = ""
