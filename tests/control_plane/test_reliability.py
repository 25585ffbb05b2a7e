"""Reliability in the plan's price (control_plane.placement.reliability): the failure
rate and premium as table tests, and both placers preferring the pool whose nodes fail
less when the prices paid are equal, while the plan's reported cost stays in dollars paid."""

from __future__ import annotations

import pytest

from control_plane.placement import FirstFitDecreasing, PoolCapacity, ReplicaDemand
from control_plane.placement.milp import MilpPlacer
from control_plane.placement.reliability import (
    FAILURE_COST_HOURS,
    MAX_RATE,
    failure_rate,
    pool_rate,
    premium,
    with_reliability,
)

WEEK_S = 7 * 86_400.0
WEEK_H = 168.0


@pytest.mark.parametrize(
    "faults, nodes, window_s, expected",
    [
        (0, 4, WEEK_S, 0.0),  # no record: no premium
        (3, 1, WEEK_S, 3 / WEEK_H),  # one node, three faults this week
        (3, 3, WEEK_S, 1 / WEEK_H),  # the same faults spread over more nodes weigh less
        (2, 0, WEEK_S, 2 / WEEK_H),  # a pool shrunk to 0 nodes counts as 1
        (5, 2, 0.0, 0.0),  # no window: nothing to divide by
        (-1, 2, WEEK_S, 0.0),
    ],
)
def test_failure_rate(faults, nodes, window_s, expected):
    assert failure_rate(faults, nodes, window_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    "pool_faults, pool_nodes, provider_faults, provider_nodes, expected",
    [
        (0, 2, 0, 10, 0.0),
        (2, 2, 2, 10, 1 / WEEK_H + 0.25 * 2 / (10 * WEEK_H)),  # its own plus a quarter of its provider's
        (0, 2, 10, 10, 0.25 * 1 / WEEK_H),  # a clean pool of a flaky provider still pays some
    ],
)
def test_pool_rate_adds_a_share_of_the_provider(
    pool_faults, pool_nodes, provider_faults, provider_nodes, expected
):
    rate = pool_rate(pool_faults, pool_nodes, provider_faults, provider_nodes, WEEK_S)
    assert rate == pytest.approx(expected)


@pytest.mark.parametrize(
    "price, rate, expected",
    [
        (10.0, 0.0, 0.0),
        (10.0, 3 / WEEK_H, 10.0 * FAILURE_COST_HOURS * 3 / WEEK_H),  # ~43% dearer
        (0.0, 3 / WEEK_H, 1.0 * FAILURE_COST_HOURS * 3 / WEEK_H),  # a free pool still pays the floor
        (10.0, 50.0, 10.0 * FAILURE_COST_HOURS * MAX_RATE),  # a burst is bounded
        (10.0, float("nan"), 0.0),
        (32.0, 1 / 6250, 32.0 * FAILURE_COST_HOURS / 6250),  # Llama 3's rate on 8 GPUs: ~0.4%
    ],
)
def test_premium(price, rate, expected):
    assert premium(price, rate) == pytest.approx(expected)


def _pools(price: float = 2.0) -> list[PoolCapacity]:
    common = dict(gpu_model="a100", gpus_per_node=1, nodes=2, hourly_price=price, provider="cloud")
    return [
        PoolCapacity(cluster="a", name="p", region="r1", **common),
        PoolCapacity(cluster="b", name="p", region="r1", **common),
    ]


def test_with_reliability_prices_only_pools_with_a_record():
    priced = {p.key: p.reliability_premium for p in with_reliability(_pools(), {("a", "p"): 3}, {"cloud": 3})}
    assert priced[("a", "p")] > priced[("b", "p")] > 0  # b pays only its provider's share
    assert with_reliability(_pools(), {}, {}) == _pools()


@pytest.mark.parametrize("placer", [FirstFitDecreasing(), MilpPlacer(time_limit_s=10, mip_gap=0.0)])
def test_placers_prefer_the_pool_whose_nodes_fail_less(placer):
    demand = [ReplicaDemand(deployment="chat", version=1, count=2, gpu_count=1)]
    plain = placer.place(demand, _pools(), [])
    assert {a.cluster for a in plain.assignments} == {"a"}  # equal prices: the name breaks the tie
    flaky = with_reliability(_pools(), {("a", "p"): 3}, {"cloud": 3})
    result = placer.place(demand, flaky, [])
    assert {a.cluster for a in result.assignments} == {"b"}
