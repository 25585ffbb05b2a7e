"""The placer's pools after node health: capacity the control plane knows is withheld,
and each pool's reliability premium.

Pool inventory comes from the agents' heartbeats, and an agent reports a pool shrunk by
every node it holds cordoned, drained or retired (as it does for unschedulable
replicas). Subtracting those nodes again here would count them twice, so the control
plane subtracts only what the agent cannot have applied yet: a node whose latest
operator action is a cordon while its reported state is not yet a withheld one (the
cordon is on its way in the DesiredState). From the heartbeat that shows the node
cordoned, the agent's own figure stands. An uncordon is never added back early: the
agent's pools grow when it has released the node. The node's pool is the one its
faults' replicas ran on, or the cluster's only pool; a node whose pool is unknown is
left to the agent's next heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence

from control_plane.fleet_model.snapshot import FleetSnapshot, NodeRow
from control_plane.nodes.record import WITHHELD
from control_plane.placement import PoolCapacity
from control_plane.placement.reliability import with_reliability


def pending_cordons(nodes: Sequence[NodeRow], pools_of: dict[str, list[str]]) -> dict[tuple[str, str], int]:
    """(cluster, pool) -> nodes an operator cordoned that the agent has not withheld yet."""
    out: dict[tuple[str, str], int] = {}
    for n in nodes:
        if n.action != "cordon" or n.state in WITHHELD:
            continue
        pools = pools_of.get(n.cluster, [])
        pool = n.pool if n.pool in pools else pools[0] if len(pools) == 1 else ""
        if pool:
            out[(n.cluster, pool)] = out.get((n.cluster, pool), 0) + 1
    return out


def healthy_pools(snap: FleetSnapshot, pools: Sequence[PoolCapacity]) -> list[PoolCapacity]:
    """`pools` less the pending cordons, priced for their record of node faults."""
    pools_of = {c.id: [p.name for p in c.pools] for c in snap.clusters}
    pending = pending_cordons(snap.nodes, pools_of)
    shrunk = [
        p.model_copy(update={"nodes": max(0, p.nodes - pending[p.key])}) if p.key in pending else p
        for p in pools
    ]
    return with_reliability(shrunk, snap.pool_faults, snap.provider_faults)
