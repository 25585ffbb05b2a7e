"""Fleet's domain types: each name and shape more than one layer checks, with its one rule.

A cluster id is a NATS subject token and a KV key, so the admin API, the agent's
`cluster.yaml`, enrollment and the wire decoder accept exactly the same ones: a cluster
the API registers is one whose agent can heart-beat. Each name rule is a pattern string,
the one source of both the Pydantic type and the plain check.

A capacity pool has one shape (`PoolShape`): the agent's inventory on the wire, the admin
API's pools, the catalog's offers and the placer's pools extend it, and copy one into
another with `pool_shape`.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

CLUSTER_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
DEPLOYMENT_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
POOL_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$"
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
PRIORITY_CLASS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
TEAM_NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"

# A cluster id: lowercase letters, digits and dashes, 1-63 characters.
ClusterId = Annotated[str, StringConstraints(pattern=CLUSTER_ID_PATTERN)]
DeploymentName = Annotated[
    str, StringConstraints(pattern=DEPLOYMENT_NAME_PATTERN, min_length=1, max_length=63)
]
PoolName = Annotated[str, StringConstraints(pattern=POOL_NAME_PATTERN)]
# A LoRA adapter's name, which clients send as `model`.
AdapterName = Annotated[str, StringConstraints(pattern=ADAPTER_NAME_PATTERN)]
# A gateway queueing class a key's quotas name ("interactive", "batch", ...).
PriorityClassName = Annotated[str, StringConstraints(pattern=PRIORITY_CLASS_PATTERN)]
# The team a key's usage is charged to (cost reports, budgets); a URL path segment.
TeamName = Annotated[str, StringConstraints(pattern=TEAM_NAME_PATTERN)]


def is_cluster_id(value: str) -> bool:
    """Whether `value` follows the cluster id rule (for checks outside a Pydantic model)."""
    return re.fullmatch(CLUSTER_ID_PATTERN, value) is not None


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


class Coordinates(BaseModel):
    lat: float = Field(0.0, ge=-90, le=90)
    lon: float = Field(0.0, ge=-180, le=180)


# Bounds of a pool anyone may report or register: a heartbeat cannot make the control plane
# allocate per node beyond these.
MAX_POOL_NODES = 100_000
MAX_GPUS_PER_NODE = 64
MAX_GPU_MEMORY_GB = 100_000
MAX_HOURLY_PRICE = 1_000_000


class PoolShape(BaseModel):
    """What a capacity pool offers: `nodes` nodes of `gpus_per_node` x `gpu_model`, at
    `hourly_price` per node (what a provider sells). On a CPU machine `gpu_model` is "cpu"
    and the "GPUs" are replica slots, so the same placement flow runs without accelerators."""

    gpu_model: str
    gpu_memory_gb: float = Field(0.0, ge=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False)
    gpus_per_node: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)
    nodes: int = Field(1, ge=0, le=MAX_POOL_NODES)
    tier: Tier = Tier.on_demand
    hourly_price: float = Field(0.0, ge=0, le=MAX_HOURLY_PRICE, allow_inf_nan=False)


POOL_SHAPE_FIELDS = tuple(PoolShape.model_fields)


def pool_shape(source: Any) -> dict[str, Any]:
    """The pool-shape fields of any pool (a model, a database row) as keyword arguments."""
    return {name: getattr(source, name) for name in POOL_SHAPE_FIELDS}
