"""Which fault kinds count against a node: every kind but an out-of-memory, which is the
request's or the deployment's config's doing, not the hardware's."""

from __future__ import annotations

from fleet_base.node_health import FaultKind

NOT_NODE_FAULTS = frozenset({FaultKind.oom.value})


def is_node_fault(kind: str) -> bool:
    return kind not in NOT_NODE_FAULTS
