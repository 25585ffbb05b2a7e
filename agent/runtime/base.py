"""The interface between the agent and whatever runs its replicas (local processes, pods
through the Kubernetes API, simulated replicas). The daemon only ever talks to a replica through this and
over HTTP at `handle.url`."""

from __future__ import annotations

import abc
import time

from pydantic import BaseModel, Field

from fleet_base.cluster_config import ClusterConfig
from fleet_base.node_health import local_node_name
from fleet_base.protocol import ReplicaSpec, ReplicaState


class InvalidSpec(Exception):
    """A replica could not be started for a reason a retry will not fix (bad spec)."""


def startup_timeout_s(spec: ReplicaSpec, config: ClusterConfig) -> float:
    """How long a replica of `spec` may take to become ready, in every runtime: a foreign
    engine (vLLM, SGLang, llama.cpp loading a large model, compiling its kernels) gets at
    least `kubernetes.engine_startup_timeout_s`."""
    if spec.engine == "fleet":
        return config.replica.startup_timeout_s
    return max(config.replica.startup_timeout_s, config.kubernetes.engine_startup_timeout_s)


class ReplicaHandle(BaseModel):
    """Where a started replica lives; persisted (runtime.json) so a restarted agent can
    find and adopt it."""

    replica_id: str
    spec: ReplicaSpec
    url: str
    port: int = 0
    pid: int | None = None
    # Process start time as the OS reports it: guards adoption against pid reuse.
    create_time: float | None = None
    log_path: str = ""
    # runtime kubernetes: the replica's pod (namespace/name)
    pod: str = ""
    # The command line with secret values masked (`fleet_base.engines.redact_argv`).
    argv: list[str] = Field(default_factory=list)
    # runtime process: the GPU indices (CUDA_VISIBLE_DEVICES) it was given; none on a host without GPUs
    gpus: list[int] = Field(default_factory=list)
    # What the runtime wants an operator to know of how it runs (e.g. served without TLS).
    note: str = ""
    started_at: float = Field(default_factory=time.time)
    restarts: int = 0


class Probe(BaseModel):
    """One look at a replica: starting, ready or failed (with why)."""

    state: ReplicaState
    exit_code: int | None = None
    error: str = ""
    # failed because the provider reclaimed its (spot) node: the control plane re-places it
    preempted: bool = False
    # starting, but the cluster cannot schedule it (capacity the pool claimed is missing)
    unschedulable: bool = False


class Runtime(abc.ABC):
    """Starts, watches and stops replicas. Methods never raise for a replica that died;
    they report it (`Probe.state == failed`)."""

    name: str = "runtime"
    # Whether the agent drains its replicas when it is stopped (SIGTERM). False where
    # replicas belong to the cluster and outlive the agent (kubernetes pods).
    drain_on_exit: bool = True
    # The configured node name (ClusterConfig.node_name); "" means this host's name.
    node_name: str = ""

    @abc.abstractmethod
    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        """Launch a replica and return at once (it loads in the background).
        Raises InvalidSpec for a spec that can never start."""

    @abc.abstractmethod
    async def poll(self, handle: ReplicaHandle) -> Probe:
        """starting until /health says 200, then ready; failed once it exited, or did not
        become ready in time, or stopped answering (the runtime then kills it)."""

    @abc.abstractmethod
    async def stop(self, handle: ReplicaHandle, drain_timeout_s: float) -> int | None:
        """Ask the replica to drain in-flight work and exit; kill it after the timeout.
        Returns its exit code where known."""

    @abc.abstractmethod
    async def kill(self, handle: ReplicaHandle) -> None:
        """Stop it now, without draining."""

    @abc.abstractmethod
    async def adopt(self, handle: ReplicaHandle) -> bool:
        """Take over a replica started by a previous agent run if it is still the same
        live, answering replica; False (having cleaned it up) otherwise."""

    async def discover(self) -> list[ReplicaHandle]:
        """Replicas a previous agent run started that this runtime can find by itself
        (without runtime.json), for adoption; the process runtimes find none."""
        return []

    # ------------------------------------------------------------ node health

    async def replica_node(self, replica_id: str) -> str | None:
        """The node a replica runs on (None: not known, e.g. a pod not yet scheduled).
        Local runtimes run every replica on this host."""
        return local_node_name(self.node_name)

    async def cordon_node(self, node: str, reason: str) -> None:
        """Keep new replicas off `node` where the cluster schedules them (Kubernetes).
        A no-op here: on the process and sim runtimes the agent withholds the node's
        capacity itself."""
        return None

    async def uncordon_node(self, node: str) -> None:
        """Undo `cordon_node` (only what Fleet itself set)."""
        return None

    async def recycle_node(self, node: str) -> list[str]:
        """Delete Fleet's replicas on `node` so the cluster recreates them elsewhere;
        returns their replica ids. Local runtimes have nowhere else: none."""
        return []

    async def close(self) -> None:
        """Release the runtime's own resources (not the replicas)."""
        return None
