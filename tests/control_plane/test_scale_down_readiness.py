"""A scale-down stops replicas still starting before replicas that serve, in both placers,
and a region's warm standby is a ready replica. The case behind it: a cluster heard again
after its replacements were placed elsewhere, where the replacements' pool is the
preferred one. The optimizing placer still trades by cost: a warm replica goes when its
pool is dearer by more than a move is worth."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import Assignment, PoolCapacity, ReplicaDemand, get_placer
from control_plane.placement.standby import StandbyDemand, split
from fleet_base.domain import ClusterStatus, Tier
from tests.control_plane.test_milp_placement import demands_st, pools_st

PLACERS = ("ffd", "milp")


def _pool(cluster: str, price: float) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster, name="p", region="r1", gpu_model="a100", gpu_memory_gb=80.0, gpus_per_node=1,
        nodes=4, tier=Tier.on_demand, hourly_price=price, cluster_status=ClusterStatus.healthy,
    )  # fmt: skip


def _replica(rid: str, cluster: str, *, ready: bool) -> Assignment:
    return Assignment(replica_id=rid, deployment="chat", version=1, cluster=cluster, pool="p", ready=ready)


def _kept(placer: str, pools: list[PoolCapacity], current: list[Assignment], count: int) -> list[str]:
    demand = ReplicaDemand(deployment="chat", version=1, count=count)
    result = get_placer(placer).place([demand], pools, current)
    assert not result.added and len(result.removed) == len(current) - count, result
    return sorted(a.replica_id for a in result.assignments)


# (warm pool's price / new pool's price, the replicas each placer keeps)
RECOVERED = [
    (1.0, {"ffd": ["warm-1", "warm-2"], "milp": ["warm-1", "warm-2"]}),
    (1.03, {"ffd": ["warm-1", "warm-2"], "milp": ["warm-1", "warm-2"]}),
    # past (1 - f/2) / (1 - f) = 1.056 (f = move_fraction, 0.1) the optimizing placer keeps
    # the cheaper starting ones, as it would move warm replicas there anyway
    (1.1, {"ffd": ["warm-1", "warm-2"], "milp": ["new-1", "new-2"]}),
    (2.0, {"ffd": ["warm-1", "warm-2"], "milp": ["new-1", "new-2"]}),
]


@pytest.mark.parametrize("placer", PLACERS)
@pytest.mark.parametrize(("ratio", "want"), RECOVERED)
def test_warm_replicas_outlast_starting_replacements_on_a_preferred_pool(
    placer: str, ratio: float, want: dict[str, list[str]]
) -> None:
    pools = [_pool("new", 10.0), _pool("warm", 10.0 * ratio)]  # "new" first on every tie
    current = [
        _replica("warm-1", "warm", ready=True),
        _replica("warm-2", "warm", ready=True),
        _replica("new-1", "new", ready=False),
        _replica("new-2", "new", ready=False),
    ]
    assert _kept(placer, pools, current, 2) == want[placer]


@pytest.mark.parametrize("placer", PLACERS)
def test_in_one_pool_the_replica_that_serves_stays(placer: str) -> None:
    current = [
        _replica("chat-a", "c", ready=False),
        _replica("chat-b", "c", ready=False),
        _replica("chat-c", "c", ready=True),
        _replica("chat-d", "c", ready=False),
    ]
    assert _kept(placer, [_pool("c", 10.0)], current, 1) == ["chat-c"]


@pytest.mark.parametrize("placer", PLACERS)
def test_readiness_unknown_counts_as_serving_and_keeps_the_old_order(placer: str) -> None:
    """A caller that does not say (tests, offline tools) gets the preference order."""
    pools = [_pool("new", 10.0), _pool("warm", 10.0)]
    current = [
        Assignment(replica_id=rid, deployment="chat", version=1, cluster=c, pool="p")
        for rid, c in (("warm-1", "warm"), ("new-1", "new"))
    ]
    assert _kept(placer, pools, current, 1) == ["new-1"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools_st(), demands_st(), st.data())
def test_a_scale_down_never_stops_a_replica_that_serves_while_its_pool_keeps_a_starting_one(
    pools: list[PoolCapacity], demands: list[ReplicaDemand], data: st.DataObject
) -> None:
    for placer in PLACERS:
        first = get_placer(placer).place(demands, pools)
        current = [  # ids of our own: the placer's are random, and the case must replay
            a.model_copy(update={"replica_id": f"{a.deployment}-{i}", "ready": data.draw(st.booleans())})
            for i, a in enumerate(first.assignments)
        ]
        smaller = [d.model_copy(update={"count": d.count // 2}) for d in demands]
        result = get_placer(placer).place(smaller, pools, current)
        kept = {a.replica_id for a in result.assignments}
        pairs: dict[tuple, list[Assignment]] = defaultdict(list)
        for a in current:
            pairs[(a.deployment, a.version, a.pool_key)].append(a)
        for pair, group in pairs.items():
            stopped_serving = [a.replica_id for a in group if a.ready and a.replica_id not in kept]
            kept_starting = [a.replica_id for a in group if not a.ready and a.replica_id in kept]
            assert not (stopped_serving and kept_starting), (placer, pair, stopped_serving, kept_starting)


def test_a_regions_standby_is_its_ready_replica_not_its_preferred_one() -> None:
    standby = StandbyDemand(deployment="chat", version=1, regions=("r1",))
    current = [_replica("new-1", "new", ready=False), _replica("warm-1", "warm", ready=True)]
    kept = split([standby], [_pool("new", 10.0), _pool("warm", 10.0)], current).kept
    assert [a.replica_id for a in kept] == ["warm-1"]
