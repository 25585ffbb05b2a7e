"""Reliability in the plan's price: a pool whose nodes fail often costs more.

A node fault (fleet_base.node_health.is_node_fault: not an out-of-memory nor an
application XID) costs more than the minutes it takes to notice: the replicas on the node
are interrupted and moved, the node is cordoned, drained and out for remediation,
typically for a day. So a pool's
expected failures are priced as a premium per node-hour on top of what the provider
charges:

    rate     = pool faults / (pool nodes x window hours)
             + PROVIDER_WEIGHT x provider faults / (provider nodes x window hours)
    premium  = min(rate, MAX_RATE) x FAILURE_COST_HOURS x max(hourly price, MIN_NODE_PRICE)

The provider's share is there because a provider whose nodes fail elsewhere is a risk in
its other pools too (a new pool has no record of its own). The floor on the price gives a
free or reserved pool (whose nodes are already paid for) a premium as well: a failure
disrupts service whatever the node costs. At the rate the Llama 3 report measured (one
interruption per ~50,000 GPU-hours) an 8-GPU pool's premium is about 0.4% of its price; a
node that failed three times this week makes its pool about 40% dearer per node.

The premium reorders the plan (the MILP's objective, first-fit-decreasing's preference);
the plan's reported dollar cost stays what the provider charges. Pure: the caller counts
the faults (the fleet snapshot, over `RELIABILITY_WINDOW_S`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from control_plane.placement.base import PoolCapacity

RELIABILITY_WINDOW_S = 7 * 86_400.0
FAILURE_COST_HOURS = 24.0  # node-hours of the pool's price one node fault costs
MIN_NODE_PRICE = 1.0  # $/node-hour: what a failure costs at least, even on a free pool
PROVIDER_WEIGHT = 0.25
MAX_RATE = 1.0  # faults per node-hour: a bound, so a burst cannot make a price unbounded


def failure_rate(faults: int, nodes: int, window_s: float = RELIABILITY_WINDOW_S) -> float:
    """Faults per node-hour over the window (a pool of 0 nodes counts as 1)."""
    if faults <= 0 or window_s <= 0:
        return 0.0
    return faults / (max(nodes, 1) * window_s / 3600.0)


def pool_rate(
    pool_faults: int,
    pool_nodes: int,
    provider_faults: int,
    provider_nodes: int,
    window_s: float = RELIABILITY_WINDOW_S,
) -> float:
    """The pool's own rate plus a share of its provider's."""
    own = failure_rate(pool_faults, pool_nodes, window_s)
    return own + PROVIDER_WEIGHT * failure_rate(provider_faults, provider_nodes, window_s)


def premium(hourly_price: float, rate: float) -> float:
    """$ per node-hour the pool's expected failures cost."""
    if not math.isfinite(rate) or rate <= 0:
        return 0.0
    return min(rate, MAX_RATE) * FAILURE_COST_HOURS * max(hourly_price, MIN_NODE_PRICE)


def with_reliability(
    pools: Sequence[PoolCapacity],
    pool_faults: Mapping[tuple[str, str], int],
    provider_faults: Mapping[str, int],
    window_s: float = RELIABILITY_WINDOW_S,
) -> list[PoolCapacity]:
    """`pools` with `reliability_premium` set from the faults counted in the window."""
    provider_nodes: dict[str, int] = {}
    for p in pools:
        provider_nodes[p.provider] = provider_nodes.get(p.provider, 0) + p.nodes
    out = []
    for p in pools:
        rate = pool_rate(
            pool_faults.get(p.key, 0),
            p.nodes,
            provider_faults.get(p.provider, 0),
            provider_nodes.get(p.provider, 0),
            window_s,
        )
        extra = round(premium(p.hourly_price, rate), 6)
        out.append(
            p if extra == p.reliability_premium else p.model_copy(update={"reliability_premium": extra})
        )
    return out
