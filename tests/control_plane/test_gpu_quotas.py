"""GPU quotas per priority class, enforced by both placers: a class's bound stops its
growth (never evicts), its floor is placed first and never preempted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import FirstFitDecreasing, PoolCapacity, ReplicaDemand
from control_plane.placement.evaluate import priority_problems, violations
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.quotas import ClassQuota, GpuQuotas, parse_quotas
from control_plane.settings import Settings
from tests.control_plane.priority_fleet import small_pools

PLACERS = {
    "ffd": lambda q: FirstFitDecreasing(quotas=q),
    "milp": lambda q: MilpPlacer(time_limit_s=10, quotas=q),
}
POOLS = [PoolCapacity(cluster="c1", name="p", gpu_model="a100", gpus_per_node=1, nodes=4, hourly_price=1.0)]


def _d(name: str, count: int, priority: str) -> ReplicaDemand:
    return ReplicaDemand(deployment=name, version=1, count=count, priority=priority)


def _held(result, name: str) -> int:
    return sum(a.gpus for a in result.assignments if a.deployment == name)


def test_parse():
    q = parse_quotas("critical:max=16, batch:min=4;standard:min=1:max=8")
    assert q.bound("critical") == 16 and q.floor("critical") == 0
    assert q.floor("batch") == 4 and q.bound("batch") is None
    assert (q.floor("standard"), q.bound("standard")) == (1, 8)
    assert not parse_quotas("") and parse_quotas("batch:min=1")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("gold:max=1", "unknown class"),
        ("batch", "min=N and/or max=N"),
        ("batch:min=x", "expected min=N"),
        ("batch:min=4:max=2", "above max_gpus"),
        ("batch:min=1,batch:max=2", "given twice"),
    ],
)
def test_parse_refuses(text, why):
    with pytest.raises(ValueError, match=why):
        parse_quotas(text)


def test_the_fleet_setting(monkeypatch):
    monkeypatch.setenv("FLEET_GPU_QUOTAS", "critical:max=2")
    assert parse_quotas(Settings.from_env().gpu_quotas).bound("critical") == 2


@pytest.mark.parametrize("name", PLACERS)
def test_a_bound_stops_growth(name):
    placer = PLACERS[name](parse_quotas("critical:max=2"))
    result = placer.place([_d("chat", 4, "critical")], POOLS)
    assert _held(result, "chat") == 2
    assert "quota: class critical holds 2 GPU(s), max_gpus 2" in result.unplaced[0].reason


@pytest.mark.parametrize("name", PLACERS)
def test_a_bound_does_not_evict(name):
    running = FirstFitDecreasing().place([_d("chat", 4, "critical")], POOLS).assignments
    result = PLACERS[name](parse_quotas("critical:max=2")).place([_d("chat", 4, "critical")], POOLS, running)
    assert _held(result, "chat") == 4 and not result.removed


@pytest.mark.parametrize("name", PLACERS)
def test_a_floor_is_never_preempted(name):
    running = FirstFitDecreasing().place([_d("train", 4, "batch")], POOLS).assignments
    demands = [_d("train", 4, "batch"), _d("chat", 2, "critical")]
    result = PLACERS[name](parse_quotas("batch:min=3")).place(demands, POOLS, running)
    assert len(result.preempted) == 1
    assert (_held(result, "train"), _held(result, "chat")) == (3, 1)


@pytest.mark.parametrize("name", PLACERS)
def test_a_floor_is_placed_before_higher_classes(name):
    demands = [_d("train", 2, "batch"), _d("chat", 4, "critical")]
    result = PLACERS[name](parse_quotas("batch:min=2")).place(demands, POOLS)
    assert (_held(result, "train"), _held(result, "chat")) == (2, 2)
    without = PLACERS[name](GpuQuotas()).place(demands, POOLS)
    assert (_held(without, "train"), _held(without, "chat")) == (0, 4)


@st.composite
def case(draw):
    pools = draw(small_pools(node_sizes=(1, 2), max_clusters=2, prices=(1.0,), draining=False))
    names = draw(st.lists(st.sampled_from(["d0", "d1", "d2"]), unique=True, min_size=1, max_size=3))
    classes = {n: draw(st.sampled_from(["critical", "standard", "batch"])) for n in names}
    before = [_d(n, draw(st.integers(0, 4)), classes[n]) for n in names]
    after = [d.model_copy(update={"count": draw(st.integers(0, 6))}) for d in before]
    quotas = {}
    for c in ("critical", "standard", "batch"):
        low = draw(st.integers(0, 3))
        high = draw(st.one_of(st.none(), st.integers(low, 6)))
        quotas[c] = ClassQuota(min_gpus=low, max_gpus=high)
    return pools, before, after, GpuQuotas(classes=quotas)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
def test_no_plan_breaks_a_quota_or_the_priority_rule(c):
    pools, before, after, quotas = c
    running = FirstFitDecreasing().place(before, pools).assignments
    for name, make in PLACERS.items():
        result = make(quotas).place(after, pools, running)
        assert not violations(after, pools, result.assignments), name
        assert not priority_problems(after, pools, running, result, quotas), name
