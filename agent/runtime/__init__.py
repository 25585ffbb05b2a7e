"""How the agent runs replicas: one `Runtime` interface; `process` (engine replicas),
`kubernetes` (one pod per replica through the Kubernetes API) and `sim` (simulated
replicas) implementations."""

from __future__ import annotations

from agent.runtime.base import InvalidSpec, Probe, ReplicaHandle, Runtime
from fleet_base.cluster_config import ClusterConfig


def make_runtime(config: ClusterConfig) -> Runtime:
    """The runtime named by `config.runtime`."""
    if config.runtime == "process":
        from agent.runtime.process import ProcessRuntime

        return ProcessRuntime(config)
    if config.runtime == "sim":
        from agent.runtime.sim import SimRuntime

        return SimRuntime(config)
    if config.runtime == "kubernetes":
        from agent.runtime.kubernetes import KubernetesRuntime

        return KubernetesRuntime(config)
    raise ValueError(f"unknown runtime {config.runtime!r}")


__all__ = ["InvalidSpec", "Probe", "ReplicaHandle", "Runtime", "make_runtime"]
