"""How the agent runs replicas: one `Runtime` interface, a `process` implementation."""

from __future__ import annotations

from agent.config import ClusterConfig
from agent.runtime.base import InvalidSpec, Probe, ReplicaHandle, Runtime


def make_runtime(config: ClusterConfig) -> Runtime:
    """The runtime named by `config.runtime`."""
    if config.runtime == "process":
        from agent.runtime.process import ProcessRuntime

        return ProcessRuntime(config)
    raise ValueError(f"unknown runtime {config.runtime!r}")


__all__ = ["InvalidSpec", "Probe", "ReplicaHandle", "Runtime", "make_runtime"]
