"""Deployment priority classes in first-fit-decreasing placement: a higher class may
preempt replicas of a strictly lower class to place its demand, never the reverse."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from control_plane.placement import PRIORITY_RANK, FirstFitDecreasing
from control_plane.placement.evaluate import violations
from tests.control_plane.priority_fleet import demand, pool, priority_fleet

FFD = FirstFitDecreasing()


def test_critical_scale_up_takes_slots_from_batch():
    pools = [pool(nodes=4)]
    running = FFD.place([demand("train", 4, "batch")], pools).assignments
    result = FFD.place([demand("train", 4, "batch"), demand("chat", 2, "critical")], pools, running)
    assert sum(1 for a in result.added if a.deployment == "chat") == 2
    assert len(result.preempted) == 2
    assert {p.deployment for p in result.preempted} == {"train"}
    assert set(result.removed) == {p.replica_id for p in result.preempted}
    assert all("preempted" in p.reason and "chat" in p.reason for p in result.preempted)
    short = {u.deployment: u for u in result.unplaced}
    assert short["train"].missing == 2 and "preempted by chat (critical)" in short["train"].reason


def test_equal_or_lower_class_never_preempts():
    pools = [pool(nodes=2)]
    for running_class, new_class in [("standard", "standard"), ("critical", "standard"), ("batch", "batch")]:
        running = FFD.place([demand("a", 2, running_class)], pools).assignments
        result = FFD.place([demand("a", 2, running_class), demand("b", 1, new_class)], pools, running)
        assert not result.preempted and not result.removed, (running_class, new_class)
        assert [u.deployment for u in result.unplaced] == ["b"]


def test_free_capacity_is_used_before_preempting():
    pools = [pool(nodes=3)]
    running = FFD.place([demand("train", 2, "batch")], pools).assignments
    result = FFD.place([demand("train", 2, "batch"), demand("chat", 2, "critical")], pools, running)
    assert len(result.preempted) == 1


def test_the_lowest_class_goes_first():
    pools = [pool(nodes=2)]
    running = FFD.place([demand("web", 1, "standard"), demand("train", 1, "batch")], pools).assignments
    demands = [demand("web", 1, "standard"), demand("train", 1, "batch"), demand("chat", 1, "critical")]
    result = FFD.place(demands, pools, running)
    assert [p.deployment for p in result.preempted] == ["train"]


def test_a_big_replica_preempts_a_whole_node():
    pools = [pool(nodes=2, gpus_per_node=4)]
    running = FFD.place([demand("train", 8, "batch")], pools).assignments
    result = FFD.place([demand("train", 8, "batch"), demand("chat", 1, "standard", gpus=4)], pools, running)
    assert len(result.preempted) == 4
    assert len({(p.replica_id) for p in result.preempted}) == 4
    assert not violations(
        [demand("train", 8, "batch"), demand("chat", 1, "standard", gpus=4)], pools, result.assignments
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(priority_fleet())
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
