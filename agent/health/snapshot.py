"""nodes.json in the cluster's state_dir: each node's health and its fault counts, written
by the agent, read by the gateway for `fleet_agent_node_state` and
`fleet_agent_gpu_errors_total` on its /metrics (as replicas.json feeds the replica metrics)."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field, ValidationError

from fleet_base.local_state import LocalState
from fleet_base.node_health import MAX_NODES, FaultKind, NodeHealth

NODES_FILE = "nodes.json"


class FaultCount(BaseModel):
    node: str
    gpu: int | None = None
    kind: FaultKind
    count: int = Field(0, ge=0)


class NodeSnapshot(BaseModel):
    nodes: list[NodeHealth] = Field(default_factory=list, max_length=MAX_NODES)
    errors: list[FaultCount] = Field(default_factory=list)
    updated_at: float = Field(default_factory=time.time)


def save(files: LocalState, snapshot: NodeSnapshot) -> None:
    files.write_bytes(files.dir / NODES_FILE, snapshot.model_dump_json(indent=1).encode())


def load(files: LocalState) -> NodeSnapshot | None:
    try:
        return NodeSnapshot.model_validate_json((files.dir / NODES_FILE).read_bytes())
    except (OSError, ValidationError, ValueError):
        return None
