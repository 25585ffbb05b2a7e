"""Deployment priority classes in first-fit-decreasing placement: a higher class may
preempt replicas of a strictly lower class to place its demand, never the reverse."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import PRIORITY_RANK, FirstFitDecreasing, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import violations
from fleet_base.domain import ClusterStatus

FFD = FirstFitDecreasing()
CLASSES = list(PRIORITY_RANK)


def _pool(nodes: int = 4, gpus_per_node: int = 1, cluster: str = "c1") -> PoolCapacity:
    return PoolCapacity(cluster=cluster, name="p", gpu_model="a100", gpus_per_node=gpus_per_node, nodes=nodes)


def _d(name: str, count: int, priority: str = "standard", gpus: int = 1) -> ReplicaDemand:
    return ReplicaDemand(deployment=name, version=1, count=count, priority=priority, gpu_count=gpus)


def test_critical_scale_up_takes_slots_from_batch():
    pools = [_pool(nodes=4)]
    running = FFD.place([_d("train", 4, "batch")], pools).assignments
    result = FFD.place([_d("train", 4, "batch"), _d("chat", 2, "critical")], pools, running)
    assert sum(1 for a in result.added if a.deployment == "chat") == 2
    assert len(result.preempted) == 2
    assert {p.deployment for p in result.preempted} == {"train"}
    assert set(result.removed) == {p.replica_id for p in result.preempted}
    assert all("preempted" in p.reason and "chat" in p.reason for p in result.preempted)
    short = {u.deployment: u for u in result.unplaced}
    assert short["train"].missing == 2 and "preempted by chat (critical)" in short["train"].reason


def test_equal_or_lower_class_never_preempts():
    pools = [_pool(nodes=2)]
    for running_class, new_class in [("standard", "standard"), ("critical", "standard"), ("batch", "batch")]:
        running = FFD.place([_d("a", 2, running_class)], pools).assignments
        result = FFD.place([_d("a", 2, running_class), _d("b", 1, new_class)], pools, running)
        assert not result.preempted and not result.removed, (running_class, new_class)
        assert [u.deployment for u in result.unplaced] == ["b"]


def test_free_capacity_is_used_before_preempting():
    pools = [_pool(nodes=3)]
    running = FFD.place([_d("train", 2, "batch")], pools).assignments
    result = FFD.place([_d("train", 2, "batch"), _d("chat", 2, "critical")], pools, running)
    assert len(result.preempted) == 1


def test_the_lowest_class_goes_first():
    pools = [_pool(nodes=2)]
    running = FFD.place([_d("web", 1, "standard"), _d("train", 1, "batch")], pools).assignments
    demands = [_d("web", 1, "standard"), _d("train", 1, "batch"), _d("chat", 1, "critical")]
    result = FFD.place(demands, pools, running)
    assert [p.deployment for p in result.preempted] == ["train"]


def test_a_big_replica_preempts_a_whole_node():
    pools = [_pool(nodes=2, gpus_per_node=4)]
    running = FFD.place([_d("train", 8, "batch")], pools).assignments
    result = FFD.place([_d("train", 8, "batch"), _d("chat", 1, "standard", gpus=4)], pools, running)
    assert len(result.preempted) == 4
    assert len({(p.replica_id) for p in result.preempted}) == 4
    assert not violations(
        [_d("train", 8, "batch"), _d("chat", 1, "standard", gpus=4)], pools, result.assignments
    )


@st.composite
def fleet(draw):
    pools = [
        PoolCapacity(
            cluster=f"c{i}",
            name="p",
            gpu_model="a100",
            gpus_per_node=draw(st.sampled_from([1, 2, 4])),
            nodes=draw(st.integers(0, 3)),
            cluster_status=draw(st.sampled_from([ClusterStatus.healthy] * 3 + [ClusterStatus.draining])),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    names = draw(st.lists(st.sampled_from(["d0", "d1", "d2", "d3"]), unique=True, min_size=1, max_size=4))
    before = [
        ReplicaDemand(
            deployment=n,
            version=1,
            count=draw(st.integers(0, 5)),
            gpu_count=draw(st.sampled_from([1, 2])),
            priority=draw(st.sampled_from(CLASSES)),
        )
        for n in names
    ]
    after = [d.model_copy(update={"count": draw(st.integers(0, 8))}) for d in before]
    return pools, before, after


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet())
def test_no_plan_preempts_an_equal_or_higher_class(case):
    pools, before, after = case
    running = FFD.place(before, pools).assignments
    result = FFD.place(after, pools, running)
    rank = {d.deployment: d.rank for d in after}
    running_ids = {a.replica_id for a in running}
    for p in result.preempted:
        assert PRIORITY_RANK[p.priority] < PRIORITY_RANK[p.by_priority]
        assert rank[p.deployment] < rank[p.by_deployment]
        assert p.replica_id in running_ids and p.replica_id in result.removed
    assert not violations(after, pools, result.assignments)
