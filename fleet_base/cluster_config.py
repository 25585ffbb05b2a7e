"""A cluster's agent/gateway configuration (`cluster.yaml`), validated at the edge."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleet_base.batch.config import BatchConfig
from fleet_base.domain import ClusterId, Coordinates
from fleet_base.kube_config import KubernetesConfig
from fleet_base.node_health import NODE_NAME_MAX, NODE_NAME_PATTERN
from fleet_base.protocol import PoolInventory
from fleet_base.security.tls import Credentials

RuntimeName = Literal["process", "sim", "kubernetes"]

# The gateway's replica choices (agent.gateway.plan): the one list config, plan and
# `fleetctl simulate` accept.
Routing = Literal["least-load", "prefix"]
ROUTINGS: tuple[str, ...] = get_args(Routing)


class GatewayConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(9000, ge=0, le=65535)
    # The URL peers and clients use; defaults to http://host:port.
    public_url: str = ""
    # Requests waiting for a ready replica: at most this many, for at most this long.
    queue_size: int = Field(256, ge=0)
    queue_timeout_s: float = Field(10.0, ge=0)
    # ... or this long while the deployment has no ready replica here (scale from zero
    # waits for a cold start instead of failing).
    cold_start_timeout_s: float = Field(300.0, ge=0)
    # Largest request body accepted (bytes).
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Queueing classes, highest first; a key's Quotas.priority_class picks one, else
    # default_class. A request queued max_queue_age_s or longer goes before younger ones.
    priority_classes: list[str] = Field(
        default_factory=lambda: ["interactive", "standard", "batch"], min_length=1
    )
    default_class: str = "standard"
    max_queue_age_s: float = Field(5.0, gt=0)
    # The fraction of queue_size one key's waiting requests may hold (past it: 429), so
    # a key flooding the queue leaves room for the others; keys take turns for slots.
    queue_share_per_key: float = Field(0.75, gt=0, le=1)
    # Requests in flight per ready replica before new ones queue here: per deployment
    # `concurrency_targets`, else the replica's engine_args max_num_seqs, else this.
    concurrency_target: int = Field(128, ge=1)
    concurrency_targets: dict[str, int] = Field(default_factory=dict)
    # Forward a new request to the nearest peer with replicas (RoutingTable.by_region)
    # once this many per ready replica wait here; None: only when none is ready.
    spill_queue_per_replica: float | None = Field(None, gt=0)
    # Seconds in a quota "minute" (a day is 1440 of them): 60; tests shorten it.
    quota_minute_s: float = Field(60.0, gt=0)
    # The HTTPS listener peer gateways forward to (mutual TLS with the fleet CA, plus a
    # signed peer token); 0: none. Its URL is what enrollment registers for peers.
    peer_port: int = Field(0, ge=0, le=65535)
    public_peer_url: str = ""
    # Revocation when the key state goes stale (the agent or NATS or the control plane is
    # gone and the key set's lease is older than key_state_max_age_s): "verified" serves
    # only keys this gateway verified while fresh, "refuse" refuses every key (docs/security.md).
    key_state_max_age_s: float = Field(180.0, gt=0)
    stale_keys: Literal["verified", "refuse"] = "verified"
    # /metrics needs a bearer key with the "metrics" or "read" scope.
    protect_metrics: bool = False
    # Replica choice (agent.gateway.plan): "prefix" picks the least expected time to first
    # token (the prefill queued there, then what cached prefix blocks, from the replicas' KV
    # events, do not save); "least-load" only outstanding work. prefix_tokens_per_s is the
    # prefill speed of replicas whose profile is unknown (and of peers, RTT added).
    routing: Routing = "prefix"
    prefix_tokens_per_s: float = Field(4000.0, gt=0)
    prefix_index_blocks: int = Field(65536, ge=1)  # block hashes remembered per replica
    # ...and per cluster (its replicas, and their blocks together), so one cluster's
    # events cannot crowd out another's; and each cluster's budget of KV-event messages
    # (and their bytes) per second, past which its batches are dropped before parsing.
    prefix_index_cluster_replicas: int = Field(256, ge=1)
    prefix_index_cluster_blocks: int = Field(262144, ge=1)
    kv_events_per_s: float = Field(1000.0, gt=0)
    kv_events_bytes_per_s: float = Field(2 * 1024 * 1024, gt=0)
    # Per-attempt limits at a replica or peer, so a hung one costs seconds, not a long
    # read timeout: until the first byte of a stream; between chunks after it; and for a
    # non-streamed answer (whole generation) first_byte + token_timeout_s per token asked.
    first_byte_timeout_s: float = Field(60.0, gt=0)
    inter_chunk_timeout_s: float = Field(30.0, gt=0)
    # A stream whose client accepts no bytes for this long (it stopped reading) is ended:
    # its upstream is closed (the replica aborts the generation) and its slot released.
    client_write_timeout_s: float = Field(30.0, gt=0)
    token_timeout_s: float = Field(0.5, ge=0)
    # A stream whose upstream fails mid-flight continues on the next target of the routing
    # plan, with the tokens generated so far (agent.gateway.migration), at most this many
    # times; 0: it ends with an in-band error event.
    migration_limit: int = Field(3, ge=0, le=16)
    # The context window assumed for a deployment whose engine_args give no max_model_len:
    # a chat request without max_tokens reserves quota for the context it may fill.
    default_context_tokens: int = Field(8192, ge=1)
    # One access log line per request when it ends (logger agent.gateway.access, INFO
    # whatever --log-level says), with its trace id when tracing is on (docs/tracing.md).
    access_log: bool = False

    @property
    def url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        if self.public_peer_url:
            return self.public_peer_url
        return f"https://{self.host}:{self.peer_port}" if self.peer_port else ""


class ReplicaConfig(BaseModel):
    """How the process runtime launches engine replicas on this host."""

    host: str = "127.0.0.1"
    # Extra `python -m engine.server` flags for every replica here (e.g. --threads 1).
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)
    # Crash restarts back off exponentially from this, up to restart_backoff_max_s.
    restart_backoff_s: float = Field(1.0, ge=0)
    restart_backoff_max_s: float = Field(60.0, ge=0)
    # Each replica's log (state_dir/logs/<replica_id>.log) is rotated above this size,
    # keeping log_backups older copies: at most (log_backups + 1) x log_max_bytes a replica.
    log_max_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    log_backups: int = Field(3, ge=0, le=100)


class HealthConfig(BaseModel):
    """Node and GPU health (agent/health): how faults are read, when a node is cordoned."""

    enabled: bool = True
    nvml_interval_s: float = Field(5.0, gt=0)
    # the correctness probe: a fixed greedy request, repeated when idle and, rarer, when busy
    probe_idle_s: float = Field(30.0, gt=0)
    probe_busy_s: float = Field(300.0, gt=0)
    probe_max_tokens: int = Field(8, ge=1, le=64)
    probe_timeout_s: float = Field(10.0, gt=0)
    # soft faults (thermal, a stall, a crash): suspect at the first, cordoned at the Nth
    # within the window; a suspect node with none for quiet_s is healthy again
    soft_faults_to_cordon: int = Field(3, ge=1)
    soft_window_s: float = Field(600.0, gt=0)
    quiet_s: float = Field(300.0, gt=0)
    # cordoned by the agent flap_cordons times within flap_window_s: retired
    flap_cordons: int = Field(3, ge=1)
    flap_window_s: float = Field(86400.0, gt=0)
    # replicas crashing this often on the same GPUs within the window: a crash loop
    crash_loop_crashes: int = Field(3, ge=2)
    crash_loop_window_s: float = Field(600.0, gt=0)
    # uncorrectable ECC errors the volatile count may rise by before it is a fault
    ecc_uncorrectable_rise: int = Field(1, ge=1)
    # each fault is repeated in heartbeats this long
    fault_report_s: float = Field(30.0, gt=0)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: ClusterId
    provider: str = "local"
    region: str = ""
    coordinates: Coordinates = Field(default_factory=Coordinates)
    nats_url: str = "nats://127.0.0.1:4222"
    state_dir: Path = Path("~/.fleet/clusters/default")
    runtime: RuntimeName = "process"
    # The node replicas run on (process and sim runtimes): "" is this host's name reduced
    # to a NodeName (fleet_base.node_health.local_node_name); Kubernetes uses the pod's node.
    node_name: str = Field("", max_length=NODE_NAME_MAX, pattern=f"^$|{NODE_NAME_PATTERN}")
    heartbeat_interval_s: float = Field(1.0, gt=0)
    # Declared pools; empty means detect GPUs (nvidia-smi), else one CPU pool of
    # `cpu_slots` replica slots so the same flow runs on a machine without GPUs.
    pools: list[PoolInventory] = Field(default_factory=list)
    cpu_slots: int = Field(2, ge=0)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    # runtime `kubernetes` only: API, image, pools -> node pools, model volume
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    # The cluster's credential bundle (`fleetctl clusters enroll`); empty: no TLS (tests).
    security: Credentials = Field(default_factory=Credentials)
    # The node's model cache (fleet_base.models): None takes $FLEET_MODEL_CACHE, else
    # $FLEET_HOME/models; replicas get the same folder. Bounded at model_cache_max_bytes
    # (None: $FLEET_MODEL_CACHE_MAX_BYTES, else only by the disk).
    model_cache_dir: Path | None = None
    model_cache_max_bytes: int | None = Field(None, ge=1)

    @field_validator("state_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return Path(value).expanduser()

    @property
    def region_or_cluster(self) -> str:
        return self.region or self.cluster

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))
