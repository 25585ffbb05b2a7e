"""Small fleets of mixed priority classes, for the placers' priority and quota tests."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from control_plane.placement import PRIORITY_RANK, PoolCapacity, ReplicaDemand
from fleet_base.domain import ClusterStatus

CLASSES = list(PRIORITY_RANK)


def pool(nodes: int = 4, gpus_per_node: int = 1, cluster: str = "c1", price: float = 0.0) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster,
        name="p",
        gpu_model="a100",
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        hourly_price=price,
    )


def demand(name: str, count: int, priority: str = "standard", gpus: int = 1) -> ReplicaDemand:
    return ReplicaDemand(deployment=name, version=1, count=count, priority=priority, gpu_count=gpus)


@st.composite
def small_pools(
    draw,
    node_sizes: Sequence[int] = (1, 2, 4),
    max_clusters: int = 3,
    prices: Sequence[float] = (0.0,),
    draining: bool = True,
) -> list[PoolCapacity]:
    """One a100 pool per cluster, 0-3 nodes each; some clusters draining when `draining`."""
    statuses = [ClusterStatus.healthy] * 3 + ([ClusterStatus.draining] if draining else [])
    return [
        PoolCapacity(
            cluster=f"c{i}",
            name="p",
            gpu_model="a100",
            gpus_per_node=draw(st.sampled_from(node_sizes)),
            nodes=draw(st.integers(0, 3)),
            hourly_price=draw(st.sampled_from(prices)),
            cluster_status=draw(st.sampled_from(statuses)),
        )
        for i in range(draw(st.integers(1, max_clusters)))
    ]


@st.composite
def priority_fleet(draw, prices: Sequence[float] = (0.0,)):
    """(pools, demands before, demands after): up to four deployments of random classes
    whose counts change between the two."""
    pools = draw(small_pools(prices=prices))
    names = draw(st.lists(st.sampled_from(["d0", "d1", "d2", "d3"]), unique=True, min_size=1, max_size=4))
    before = [
        demand(n, draw(st.integers(0, 5)), draw(st.sampled_from(CLASSES)), draw(st.sampled_from([1, 2])))
        for n in names
    ]
    after = [d.model_copy(update={"count": draw(st.integers(0, 8))}) for d in before]
    return pools, before, after
