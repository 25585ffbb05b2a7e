"""The optimizing placer (HiGHS MILP): every plan keeps every rule, costs no less than
the LP bound, matches brute force on tiny instances, re-plans stably, and says which
constraint cannot be met."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane.placement import Assignment, FirstFitDecreasing, PoolCapacity, ReplicaDemand, get_placer
from control_plane.placement.evaluate import committed_cost, plan_cost, regions_of, slot_size, violations
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.pipeline import PlacementInputs, run
from fleet_base.domain import ClusterStatus, Tier

REGIONS = ["r1", "r2", "r3"]
MODELS = ["a100", "h100"]
PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT = MilpPlacer(time_limit_s=20, mip_gap=0.0)
COLD = MilpPlacer(time_limit_s=20, mip_gap=0.0, ffd_warm_limit=0)  # no FFD seed: the model alone


@st.composite
def pools_st(draw, max_pools: int = 6, max_nodes: int = 3) -> list[PoolCapacity]:
    out = []
    for i in range(draw(st.integers(1, max_pools))):
        out.append(
            PoolCapacity(
                cluster=f"c{i}",
                name="p",
                region=draw(st.sampled_from(REGIONS)),
                gpu_model=draw(st.sampled_from(MODELS)),
                gpu_memory_gb=draw(st.sampled_from([40.0, 80.0])),
                gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
                nodes=draw(st.integers(0, max_nodes)),
                tier=draw(st.sampled_from(list(Tier))),
                hourly_price=draw(st.sampled_from([0.5, 1.0, 2.5, 4.0, 7.0])),
                cluster_status=draw(st.sampled_from([ClusterStatus.healthy] * 4 + [ClusterStatus.draining])),
            )
        )
    return out


@st.composite
def demands_st(draw, max_demands: int = 3, max_count: int = 6) -> list[ReplicaDemand]:
    names = draw(
        st.lists(st.sampled_from(["d0", "d1", "d2", "d3"]), unique=True, min_size=1, max_size=max_demands)
    )
    return [
        ReplicaDemand(
            deployment=name,
            version=1,
            count=draw(st.integers(0, max_count)),
            gpu_models=tuple(draw(st.lists(st.sampled_from(MODELS), unique=True, max_size=2))),
            gpu_count=draw(st.sampled_from([1, 1, 2, 4])),
            gpu_memory_gb=draw(st.sampled_from([0.0, 0.0, 80.0])),
            regions=tuple(draw(st.lists(st.sampled_from(["r1", "r2", "r*"]), unique=True, max_size=2))),
            min_regions=draw(st.integers(1, 3)),
            max_spot_fraction=draw(st.sampled_from([0.0, 0.5, 1.0])),
        )
        for name in names
    ]


def _missing(result) -> int:
    return sum(u.missing for u in result.unplaced)


@PROFILE
@given(pools_st(), demands_st())
def test_every_plan_keeps_every_constraint_and_costs_at_least_the_lp_bound(pools, demands):
    placer = EXACT if len(pools) % 2 else COLD
    result, info = placer.solve(demands, pools, lp_bound=True)
    assert violations(demands, pools, result.assignments) == []
    placed = Counter((a.deployment, a.version) for a in result.assignments)
    short = {(u.deployment, u.version): u for u in result.unplaced}
    for d in demands:
        assert placed[d.key] + (short[d.key].missing if d.key in short else 0) == d.count
        k = min(d.min_regions, placed[d.key])
        if len(regions_of(d, pools, result.assignments)) < k:
            assert d.key in short and "min_regions" in short[d.key].reason
    assert info.cost == pytest.approx(plan_cost(pools, result.assignments))
    if not result.unplaced and info.lp_bound is not None:
        assert info.cost >= info.lp_bound - 1e-6
    # a second pass over its own answer changes nothing
    again = MilpPlacer(time_limit_s=20, mip_gap=0.0).place(demands, pools, result.assignments)
    assert not again.added and not again.removed


def _brute_force(demands, pools) -> float:
    """min over every split of every demand's replicas among its pools (and 'unplaced')
    of the MILP's weighted objective: BIG * unplaced + BIG/2 * missing regions + cost."""
    big = 100.0 * (max([p.hourly_price for p in pools] + [1.0]) + 1.0)
    options = []
    for d in demands:
        ok = [p for p in pools if d.acceptable(p) and p.accepts_new]
        splits = []
        for combo in itertools.product(range(d.count + 1), repeat=len(ok)):
            if sum(combo) <= d.count:
                splits.append({p.key: n for p, n in zip(ok, combo, strict=True) if n})
        options.append(splits)
    by_pool = {p.key: p for p in pools}
    best = math.inf
    for choice in itertools.product(*options):
        gpus: Counter = Counter()
        value = 0.0
        feasible = True
        for d, split in zip(demands, choice, strict=True):
            placed = sum(split.values())
            spot = sum(n for k, n in split.items() if by_pool[k].tier == Tier.spot)
            if spot > d.max_spot:
                feasible = False
                break
            value += big * (d.count - placed)
            regions = {by_pool[k].region for k in split}
            if min(d.min_regions, d.count) > 1:  # the active-active rule starts at two regions
                value += big / 2 * max(0, min(d.min_regions, d.count) - len(regions))
            for k, n in split.items():
                gpus[k] += n * slot_size(d.gpu_count, by_pool[k].gpus_per_node)
        if not feasible:
            continue
        for k, g in gpus.items():
            p = by_pool[k]
            nodes = math.ceil(g / p.gpus_per_node - 1e-9)
            if nodes > p.nodes:
                feasible = False
                break
            if p.tier != Tier.reserved:
                value += nodes * p.hourly_price
        if feasible:
            best = min(best, value)
    return best + committed_cost(pools)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools_st(max_pools=3, max_nodes=2), demands_st(max_demands=2, max_count=3))
def test_tiny_instances_match_brute_force(pools, demands):
    pools = [p.model_copy(update={"cluster_status": ClusterStatus.healthy}) for p in pools]
    result, info = COLD.solve(demands, pools)
    big = 100.0 * (max([p.hourly_price for p in pools] + [1.0]) + 1.0)
    missing_regions = 0
    for d in demands:
        placed = sum(1 for a in result.assignments if a.deployment == d.deployment)
        if min(d.min_regions, d.count) > 1:
            missing_regions += max(
                0, min(d.min_regions, d.count) - len(regions_of(d, pools, result.assignments))
            )
        assert placed <= d.count
    value = info.cost + big * _missing(result) + big / 2 * missing_regions
    assert value == pytest.approx(_brute_force(demands, pools), abs=1e-6)


def _pool(
    cluster, region, tier=Tier.on_demand, price=2.0, nodes=4, gpus=8, model="h100", mem=80.0
) -> PoolCapacity:
    return PoolCapacity(
        cluster=cluster, name="p", region=region, gpu_model=model, gpu_memory_gb=mem,
        gpus_per_node=gpus, nodes=nodes, tier=tier, hourly_price=price,
    )  # fmt: skip


def test_packs_replicas_onto_shared_nodes_and_uses_reserved_first():
    pools = [
        _pool("res", "r1", Tier.reserved, price=10.0, nodes=1),
        _pool("od", "r1", price=8.0),
        _pool("sp", "r2", Tier.spot, price=3.0),
    ]
    demands = [ReplicaDemand(deployment="a", version=1, count=6, gpu_count=2, max_spot_fraction=0.0)]
    result, info = EXACT.solve(demands, pools, lp_bound=True)
    by = Counter(a.cluster for a in result.assignments)
    assert by == {"res": 4, "od": 2}  # the reserved node is full, one on-demand node for the rest
    assert {a.node for a in result.assignments if a.cluster == "od"} == {0}
    assert info.cost == pytest.approx(10.0 + 8.0)
    assert info.lp_bound == pytest.approx(10.0 + 8.0 * 4 / 8)


def test_spot_share_and_min_regions_are_honoured():
    pools = [
        _pool("sp1", "r1", Tier.spot, price=1.0),
        _pool("sp2", "r2", Tier.spot, price=1.0),
        _pool("od", "r3", price=20.0),
    ]
    d = ReplicaDemand(deployment="a", version=1, count=4, gpu_count=8, min_regions=3, max_spot_fraction=0.5)
    result = EXACT.place([d], pools)
    by = Counter(a.cluster for a in result.assignments)
    assert sum(by[c] for c in ("sp1", "sp2")) == 2 and by["od"] == 2
    assert len(regions_of(d, pools, result.assignments)) == 3
    assert not result.unplaced


@pytest.mark.parametrize(
    ("demand", "pools", "phrase"),
    [
        (dict(gpu_models=("b200",)), [_pool("a", "r1")], "gpu_models"),
        (dict(gpu_memory_gb=141), [_pool("a", "r1")], "gpu_memory_gb"),
        (dict(regions=("eu-*",)), [_pool("a", "us-east1")], "regions"),
        (dict(count=9, gpu_count=8), [_pool("a", "r1", nodes=2)], "capacity"),
        (
            dict(count=4, gpu_count=8, max_spot_fraction=0.25),
            [_pool("a", "r1", Tier.spot, nodes=8), _pool("b", "r1", nodes=1)],
            "max_spot_fraction",
        ),
        (dict(count=2, min_regions=2), [_pool("a", "r1")], "min_regions"),
    ],
)
def test_says_which_constraint_cannot_be_met(demand, pools, phrase):
    d = ReplicaDemand(deployment="a", version=1, **{"count": 1, **demand})
    result = EXACT.place([d], pools)
    assert violations([d], pools, result.assignments) == []
    assert len(result.unplaced) == 1 and phrase in result.unplaced[0].reason


def test_replan_after_a_small_change_moves_little():
    pools = [_pool(f"c{i}", f"r{i % 3}", price=1.0 + i / 10, nodes=6) for i in range(8)]
    demands = [
        ReplicaDemand(deployment=f"d{i}", version=1, count=10, gpu_count=1 + i % 2, min_regions=2)
        for i in range(5)
    ]
    first = EXACT.place(demands, pools)
    grown = [d.model_copy(update={"count": d.count + 1}) if d.deployment == "d0" else d for d in demands]
    second = EXACT.place(grown, pools, first.assignments)
    assert len(second.added) == 1 and second.removed == ()


def test_unhealthy_cluster_is_replaced_and_draining_keeps_but_gets_nothing_new():
    pools = [_pool("a", "r1", price=1.0), _pool("b", "r2", price=5.0)]
    d = ReplicaDemand(deployment="x", version=1, count=2, gpu_count=8)
    first = EXACT.place([d], pools)
    assert {a.cluster for a in first.assignments} == {"a"}
    sick = [pools[0].model_copy(update={"cluster_status": ClusterStatus.unhealthy}), pools[1]]
    second = EXACT.place([d], sick, first.assignments)
    assert {a.cluster for a in second.assignments} == {"b"} and len(second.removed) == 2
    cordoned = [pools[0].model_copy(update={"cluster_status": ClusterStatus.draining}), pools[1]]
    grown = d.model_copy(update={"count": 3})
    third = EXACT.place([grown], cordoned, first.assignments)
    assert Counter(a.cluster for a in third.assignments) == {"a": 2, "b": 1}


def test_demand_regions_break_ties_toward_clients():
    pools = [_pool("east", "us-east1", price=2.0), _pool("tokyo", "asia-northeast1", price=2.0)]
    pools = [p.model_copy(update={"provider": "gcp"}) for p in pools]
    d = ReplicaDemand(
        deployment="x", version=1, count=1, gpu_count=8, demand_regions={"asia-northeast1": 1.0}
    )
    assert EXACT.place([d], pools).added[0].cluster == "tokyo"
    d2 = d.model_copy(update={"demand_regions": {"us-east4": 1.0}})
    assert EXACT.place([d2], pools).added[0].cluster == "east"


def test_huge_instances_and_solver_errors_fall_back_to_greedy():
    pools = [_pool(f"c{i}", "r1", price=1.0 + i) for i in range(4)]
    d = ReplicaDemand(deployment="x", version=1, count=3, gpu_count=8, max_spot_fraction=0.0)
    result, info = MilpPlacer(max_pairs=1).solve([d], pools)
    assert info.method == "greedy-huge" and len(result.assignments) == 3
    assert violations([d], pools, result.assignments) == []

    class Broken(MilpPlacer):
        def _solve(self, *args, **kwargs):
            raise RuntimeError("boom")

    result, info = Broken().solve([d], pools)
    assert info.method == "greedy-error" and "boom" in info.note and len(result.assignments) == 3


def test_registered_as_milp_and_ffd_still_there():
    assert isinstance(get_placer("milp"), MilpPlacer)
    assert isinstance(get_placer("ffd"), FirstFitDecreasing)


def test_greedy_plan_respects_spot_share():
    pools = [_pool("sp", "r1", Tier.spot, price=1.0, nodes=4), _pool("od", "r1", price=5.0, nodes=1)]
    d = ReplicaDemand(deployment="x", version=1, count=4, gpu_count=8, max_spot_fraction=0.5)
    result, _info = MilpPlacer(max_pairs=0).solve([d], pools)
    assert violations([d], pools, result.assignments) == []
    assert result.unplaced and "max_spot_fraction" in result.unplaced[0].reason


def test_assignment_type_is_the_placers():
    d = ReplicaDemand(deployment="x", version=1, count=1)
    result = EXACT.place([d], [_pool("a", "r1")])
    assert all(isinstance(a, Assignment) for a in result.assignments)


def test_an_unchanged_fleet_is_not_solved_again():
    pools = [_pool("a", "r1", price=1.0), _pool("b", "r2", price=2.0)]
    d = ReplicaDemand(deployment="x", version=1, count=3, gpu_count=2)
    placer = MilpPlacer()
    first = run(PlacementInputs(demands=(d,), pools=tuple(pools)), placer)
    assert first.info.method == "milp-optimal"
    again = PlacementInputs(demands=(d,), pools=tuple(pools), current=first.result.assignments)
    same = run(again, placer, previous=first.solved)
    assert same.info.method == "unchanged" and set(same.result.kept) == set(first.result.assignments)
    assert not same.result.changed
    assert run(again, placer).info.method == "milp-optimal"  # the placer itself keeps nothing
    cheaper = again.model_copy(
        update={"pools": (pools[0], pools[1].model_copy(update={"hourly_price": 0.5}))}
    )
    moved = run(cheaper, placer, previous=same.solved)
    assert moved.info.method == "milp-optimal" and {a.cluster for a in moved.result.assignments} == {"b"}


def test_warm_started_replan_keeps_every_running_replica():
    """The issue's minimal case: HiGHS, warm-started from FFD (which drops a replica here),
    reported the optimum's objective with the warm start's columns. The plan is now checked
    against the model before it is called optimal, and every running replica stays."""
    pools = [
        PoolCapacity(cluster="c0", name="p", region="r2", gpu_model="a100", gpus_per_node=2, nodes=2),
        PoolCapacity(cluster="c1", name="p", region="r1", gpu_model="a100", nodes=0, tier=Tier.reserved),
        PoolCapacity(cluster="c2", name="p", region="r1", gpu_model="a100", nodes=1, tier=Tier.spot),
        PoolCapacity(cluster="c3", name="p", region="r1", gpu_model="a100", nodes=0, tier=Tier.reserved),
    ]
    demands = [
        ReplicaDemand(deployment="d0", version=1, count=2, min_regions=2, max_spot_fraction=0.0),
        ReplicaDemand(deployment="d1", version=1, count=0),
        ReplicaDemand(deployment="d2", version=1, count=2, max_spot_fraction=0.5),
    ]
    first, _ = MilpPlacer(mip_gap=0.0, ffd_warm_limit=0).solve(demands, pools)
    assert len(first.assignments) == 4
    again, info = MilpPlacer(mip_gap=0.0).solve(demands, pools, first.assignments)
    assert info.method == "milp-optimal"
    assert {a.replica_id for a in again.assignments} == {a.replica_id for a in first.assignments}
    assert not again.removed and not again.added


@PROFILE
@given(pools_st(), demands_st())
def test_a_replan_from_its_own_plan_never_drops_a_running_replica(pools, demands):
    first, _ = COLD.solve(demands, pools)
    again, info = MilpPlacer(time_limit_s=20, mip_gap=0.0).solve(demands, pools, first.assignments)
    assert violations(demands, pools, again.assignments) == []
    if info.method == "milp-optimal":
        kept = {a.replica_id for a in again.assignments}
        assert kept >= {a.replica_id for a in first.assignments}


def test_a_scale_down_below_the_spot_share_is_solved_not_left_to_the_fallback():
    """Three replicas on spot, the only pool that takes them; scaled to 3 of which at most
    one may be on spot: two must go. The model once found that infeasible (a running
    replica may leave only by scale-down, move or preemption) and fell back to FFD."""
    spot = _pool("spot", "r1", tier=Tier.spot, price=7.0, nodes=3, gpus=8)
    d = ReplicaDemand(deployment="d", version=1, count=6, gpu_count=4, max_spot_fraction=0.5)
    first, _ = EXACT.solve([d], [spot])
    assert len(first.assignments) == 3
    again, info = EXACT.solve([d.model_copy(update={"count": 3})], [spot], first.assignments)
    assert info.method == "milp-optimal", info
    assert len(again.assignments) == 1 and len(again.removed) == 2 and not again.added
    assert violations([d.model_copy(update={"count": 3})], [spot], again.assignments) == []


@PROFILE
@given(pools_st(), demands_st())
def test_a_scale_down_from_its_own_plan_is_solved_by_the_model(pools, demands):
    first, _ = COLD.solve(demands, pools)
    smaller = [d.model_copy(update={"count": d.count // 2}) for d in demands]
    again, info = MilpPlacer(time_limit_s=20, mip_gap=0.0).solve(smaller, pools, first.assignments)
    assert info.method.startswith("milp"), info
    assert violations(smaller, pools, again.assignments) == []
