"""First-fit-decreasing placement: the policy, case by case."""

from __future__ import annotations

import re

import pytest

from control_plane.placement import (
    Assignment,
    FirstFitDecreasing,
    PoolCapacity,
    ReplicaDemand,
    get_placer,
    placer_names,
)
from fleet_base.domain import ClusterStatus, Tier


def pool(cluster="c1", name="p", region="r1", gpu="a100", mem=80.0, per_node=8, nodes=1, tier=Tier.on_demand,
         price=10.0, status=ClusterStatus.healthy) -> PoolCapacity:  # fmt: skip
    return PoolCapacity(
        cluster=cluster, name=name, region=region, gpu_model=gpu, gpu_memory_gb=mem, gpus_per_node=per_node,
        nodes=nodes, tier=tier, hourly_price=price, cluster_status=status,
    )  # fmt: skip


def demand(
    name="d", count=1, gpus=1, version=1, models=(), mem=0.0, regions=(), min_regions=1
) -> ReplicaDemand:
    return ReplicaDemand(
        deployment=name, version=version, count=count, gpu_models=tuple(models), gpu_count=gpus,
        gpu_memory_gb=mem, regions=tuple(regions), min_regions=min_regions,
    )  # fmt: skip


FFD = FirstFitDecreasing()


def where(result) -> list[tuple[str, str]]:
    return sorted((a.cluster, a.pool) for a in result.assignments)


def test_registry_has_ffd_and_rejects_unknown_names():
    assert "ffd" in placer_names()
    assert isinstance(get_placer("ffd"), FirstFitDecreasing)
    with pytest.raises(ValueError, match=r"unknown placer 'nope'.*ffd"):
        get_placer("nope")


def test_replica_ids_are_unique_and_name_the_deployment_and_version():
    res = FFD.place([demand("chat", count=5, version=3)], [pool(per_node=8)])
    ids = [a.replica_id for a in res.added]
    assert len(set(ids)) == 5
    assert all(re.fullmatch(r"chat-v3-[0-9a-f]{6}", i) for i in ids)


def test_tiers_win_over_price_then_price_decides():
    pools = [
        pool("spot", tier=Tier.spot, price=1.0),
        pool("od-cheap", tier=Tier.on_demand, price=5.0),
        pool("od-dear", tier=Tier.on_demand, price=9.0),
        pool("res", tier=Tier.reserved, price=20.0, per_node=2),
    ]
    res = FFD.place([demand(count=4)], pools)
    # reserved first (2 slots), then the cheaper on-demand pool.
    assert where(res) == [("od-cheap", "p")] * 2 + [("res", "p")] * 2


def test_price_is_compared_per_gpu_not_per_node():
    big = pool("big", per_node=8, price=16.0)  # 2/GPU
    small = pool("small", per_node=1, price=3.0)  # 3/GPU
    assert where(FFD.place([demand()], [small, big])) == [("big", "p")]


@pytest.mark.parametrize(
    ("d", "reason"),
    [
        (demand(models=["h100"]), "GPU model"),
        (demand(mem=100.0), "GPU memory"),
        (demand(regions=["eu-*"]), "region"),
        (demand(gpus=16), "GPUs per node"),
    ],
)
def test_static_constraints_leave_replicas_unplaced_with_the_reason(d, reason):
    res = FFD.place([d], [pool(region="us-east1")])
    assert not res.assignments
    (u,) = res.unplaced
    assert u.missing == 1 and reason in u.reason


def test_constraints_pick_the_matching_pool():
    pools = [
        pool("a", gpu="a100", mem=40, region="us-east1", price=1),
        pool("b", gpu="h100", mem=80, region="us-east1", price=5),
        pool("c", gpu="H100", mem=80, region="eu-west4", price=9),
    ]
    assert where(FFD.place([demand(models=["h100"])], pools)) == [("b", "p")]
    assert where(FFD.place([demand(mem=60)], pools)) == [("b", "p")]
    assert where(FFD.place([demand(regions=["eu-*"])], pools)) == [("c", "p")]
    assert where(FFD.place([demand(models=["h100"], regions=["eu-west4"])], pools)) == [("c", "p")]


def test_a_replica_never_spans_nodes():
    # 2 nodes of 8 GPUs = 16 GPUs, but only two 5-GPU replicas fit (one per node).
    res = FFD.place([demand(count=3, gpus=5)], [pool(nodes=2, per_node=8)])
    assert len(res.added) == 2
    assert sorted(a.node for a in res.added) == [0, 1]
    (u,) = res.unplaced
    assert u.missing == 1 and "free" in u.reason


def test_biggest_demands_first_packs_what_arrival_order_would_not():
    # Two 4-GPU nodes: 1-GPU replicas first would leave no node with 3 free for the second 3-GPU replica.
    res = FFD.place(
        [demand("small", count=2, gpus=1), demand("mid", count=2, gpus=3)], [pool(nodes=2, per_node=4)]
    )
    assert not res.unplaced and len(res.added) == 4


def test_no_new_replicas_on_unhealthy_or_draining_clusters():
    pools = [
        pool("sick", status=ClusterStatus.unhealthy, price=0),
        pool("cordoned", status=ClusterStatus.draining, price=0),
        pool("ok", price=50),
    ]
    assert where(FFD.place([demand(count=2)], pools)) == [("ok", "p")] * 2
    res = FFD.place([demand(count=2)], pools[:2])
    assert res.unplaced[0].missing == 2 and "healthy" in res.unplaced[0].reason


def test_replicas_on_an_unhealthy_cluster_are_replaced_elsewhere_and_draining_ones_stay():
    pools = [pool("a", price=1), pool("b", price=1), pool("c", price=5)]
    first = FFD.place([demand(count=2, min_regions=1)], pools)
    assert {a.cluster for a in first.assignments} == {"a"}
    a_ids = {a.replica_id for a in first.assignments}

    sick = [pool("a", price=1, status=ClusterStatus.unhealthy), *pools[1:]]
    res = FFD.place([demand(count=2)], sick, first.assignments)
    assert set(res.removed) == a_ids
    assert where(res) == [("b", "p")] * 2

    cordoned = [pool("a", price=1, status=ClusterStatus.draining), *pools[1:]]
    res = FFD.place([demand(count=2)], cordoned, first.assignments)
    assert not res.changed and {a.replica_id for a in res.kept} == a_ids


def test_min_regions_spreads_before_packing_cheaply():
    pools = [
        pool("cheap", region="r1", price=1, per_node=8),
        pool("mid", region="r2", price=5),
        pool("dear", region="r3", price=9),
    ]
    res = FFD.place([demand(count=4, min_regions=3)], pools)
    assert sorted(a.cluster for a in res.assignments) == ["cheap", "cheap", "dear", "mid"]
    res = FFD.place([demand(count=4, min_regions=1)], pools)
    assert {a.cluster for a in res.assignments} == {"cheap"}


def test_min_regions_unreachable_is_reported_but_replicas_still_placed():
    res = FFD.place([demand(count=3, min_regions=2)], [pool("a", region="r1")])
    assert len(res.added) == 3
    (u,) = res.unplaced
    assert u.missing == 0 and "min_regions" in u.reason


def test_min_regions_moves_one_replica_when_a_new_region_appears():
    first = FFD.place([demand(count=3, min_regions=2)], [pool("a", region="r1", price=1)])
    pools = [pool("a", region="r1", price=1), pool("b", region="r2", price=5)]
    res = FFD.place([demand(count=3, min_regions=2)], pools, first.assignments)
    assert len(res.removed) == 1 and len(res.added) == 1 and res.added[0].cluster == "b"
    assert not res.unplaced
    again = FFD.place([demand(count=3, min_regions=2)], pools, res.assignments)
    assert not again.changed


def test_placing_twice_changes_nothing_and_new_capacity_moves_nothing():
    pools = [pool("a", nodes=2, per_node=4, price=5), pool("b", price=6, region="r2")]
    demands = [demand("x", count=3, gpus=2), demand("y", count=4, gpus=1, min_regions=2)]
    first = FFD.place(demands, pools)
    assert not first.unplaced
    again = FFD.place(demands, pools, first.assignments)
    assert not again.changed and set(again.kept) == set(first.assignments)
    cheaper = [*pools, pool("new", price=0.1, tier=Tier.reserved)]
    assert not FFD.place(demands, cheaper, first.assignments).changed


def test_stable_without_stored_node_indices():
    pools = [pool("a", nodes=3, per_node=4)]
    demands = [demand("x", count=5, gpus=2), demand("y", count=2, gpus=1)]
    first = FFD.place(demands, pools)
    stripped = [a.model_copy(update={"node": None}) for a in first.assignments]
    again = FFD.place(demands, pools, stripped)
    assert not again.changed


def test_scale_up_keeps_existing_and_scale_down_drops_the_dearest_first():
    pools = [
        pool("res", tier=Tier.reserved, per_node=2, price=30),
        pool("od", price=10, per_node=2),
        pool("spot", tier=Tier.spot, price=1, per_node=4),
    ]
    three = FFD.place([demand(count=3)], pools)
    six = FFD.place([demand(count=6)], pools, three.assignments)
    assert set(three.assignments) <= set(six.kept) and len(six.added) == 3
    assert sorted(a.cluster for a in six.assignments) == ["od", "od", "res", "res", "spot", "spot"]
    two = FFD.place([demand(count=2)], pools, six.assignments)
    assert sorted(a.cluster for a in two.assignments) == ["res", "res"] and len(two.removed) == 4
    zero = FFD.place([demand(count=0)], pools, two.assignments)
    assert not zero.assignments and len(zero.removed) == 2 and not zero.unplaced


def test_scale_down_keeps_min_regions():
    pools = [pool("a", region="r1", price=1), pool("b", region="r2", price=9)]
    four = FFD.place([demand(count=4, min_regions=2)], pools)
    two = FFD.place([demand(count=2, min_regions=2)], pools, four.assignments)
    assert sorted(a.cluster for a in two.assignments) == ["a", "b"]


def test_a_new_version_replaces_old_replicas_with_new_ids():
    pools = [pool(per_node=8)]
    v1 = FFD.place([demand(count=2, version=1)], pools)
    v2 = FFD.place([demand(count=2, version=2)], pools, v1.assignments)
    assert set(v2.removed) == {a.replica_id for a in v1.assignments}
    assert {a.version for a in v2.assignments} == {2}
    assert not {a.replica_id for a in v2.added} & {a.replica_id for a in v1.assignments}


def test_deleted_deployment_and_unknown_pools_are_cleaned_up():
    pools = [pool("a"), pool("b", price=20)]
    first = FFD.place([demand("x"), demand("y")], pools)
    res = FFD.place([demand("y")], pools, first.assignments)
    assert [a.deployment for a in res.assignments] == ["y"] and len(res.removed) == 1
    ghost = Assignment(replica_id="y-v1-ghost1", deployment="y", version=1, cluster="gone", pool="p", gpus=1)
    res = FFD.place([demand("y")], pools, [ghost])
    assert res.removed == ("y-v1-ghost1",) and len(res.added) == 1


def test_cpu_pools_take_any_gpu_demand_without_model_or_memory():
    cpu = pool("local", gpu="cpu", mem=0, per_node=2)
    assert len(FFD.place([demand(count=2)], [cpu]).added) == 2
    assert FFD.place([demand(models=["a100"])], [cpu]).unplaced
