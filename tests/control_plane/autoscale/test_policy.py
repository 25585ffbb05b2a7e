"""Table tests of the autoscaling policies: a demand series in, desired replicas out.

Replicas become ready at once here (cold start is the simulator's business), so each
tick's `ready` and `current` are the previous decision."""

from __future__ import annotations

import itertools

import pytest

from control_plane.autoscale import AutoscaleSettings, Observation, ScalerState, make_policy
from tests.control_plane.autoscale.helpers import series


def run(
    policy: str,
    demand: list[tuple[float, float]],
    start: int = 1,
    queued_share: float = 0.0,
    **settings: object,
) -> list[tuple[float, int, str]]:
    """(t, demand) every tick -> [(t, desired, reason)]."""
    s = AutoscaleSettings(policy=policy, **settings)
    p, state, current = make_policy(policy), ScalerState(), start
    out = []
    for t, d in demand:
        obs = Observation(
            at=t, in_flight=d * (1 - queued_share), queued=d * queued_share, ready=current, current=current
        )
        dec = p.decide(s, state, obs)
        out.append((t, dec.desired, dec.reason))
        current = dec.desired
    return out


def at(result: list[tuple[float, int, str]], t: float) -> int:
    return next(d for tt, d, _ in result if tt >= t)


BASE = dict(target_concurrency=10.0, target_utilization=0.8, min_replicas=1, max_replicas=20)


@pytest.mark.parametrize("policy", ["concurrency", "kpa"])
def test_steady_load_settles_at_demand_over_target(policy: str) -> None:
    r = run(policy, series((0, 300, 32)), **BASE)  # 32 / (10 x 0.8) = 4
    assert {d for t, d, _ in r if t >= 60} == {4}
    assert "stable demand" in r[-1][2]


@pytest.mark.parametrize("policy", ["concurrency", "kpa"])
def test_step_up_scales_at_once(policy: str) -> None:
    r = run(policy, series((0, 60, 8), (60, 200, 80)), **BASE)
    assert at(r, 58) == 1
    assert at(r, 62) >= 5  # the panic window sees it within a tick or two
    assert at(r, 72) == 10 and "panic" in r[[t for t, _, _ in r].index(60)][2]


@pytest.mark.parametrize(
    ("policy", "held_until"),
    [("concurrency", 60), ("kpa", 60)],  # both hold through the panic (one stable window)
)
def test_burst_panics_then_holds(policy: str, held_until: float) -> None:
    r = run(policy, series((0, 100, 8), (100, 106, 120), (106, 400, 8)), **BASE)
    peak = max(d for t, d, _ in r if 100 <= t < 110)
    assert peak >= 10
    assert at(r, 100 + held_until - 2) >= peak - 1  # no scale-down while in panic
    assert at(r, 390) == 1


def test_decay_waits_for_the_scale_down_delay() -> None:
    ours = run("concurrency", series((0, 120, 80), (120, 400, 0)), start=10, **BASE)
    kpa = run("kpa", series((0, 120, 80), (120, 400, 0)), start=10, **BASE)
    # ours: the 60s window's mean falls from ~126s on; the 90s delay holds 10 until ~216s
    assert at(ours, 210) == 10 and at(ours, 230) < 10
    assert at(ours, 300) == 1
    assert any("scale-down delay" in reason for _, _, reason in ours)
    # kpa: no delay; the mean decays over 60s and each step at most halves the count
    assert at(kpa, 150) < 10
    seq = [d for t, d, _ in kpa if t >= 120]
    assert all(b >= a // 2 for a, b in itertools.pairwise(seq))  # rate-bounded


@pytest.mark.parametrize("policy", ["concurrency", "kpa", "static"])
def test_min_and_max_bounds(policy: str) -> None:
    hi = run(policy, series((0, 120, 1000)), **{**BASE, "max_replicas": 6})
    assert max(d for _, d, _ in hi) == 6
    lo = run(policy, series((0, 300, 0)), start=5, **{**BASE, "min_replicas": 2, "max_replicas": 6})
    assert lo[-1][1] == (6 if policy == "static" else 2)


@pytest.mark.parametrize("policy", ["concurrency", "kpa"])
def test_scale_to_zero_and_back(policy: str) -> None:
    s = {**BASE, "min_replicas": 0}
    r = run(policy, series((0, 20, 8), (20, 300, 0), (300, 320, 4)), **s)
    grace = 60 if policy == "concurrency" else 30
    zero_at = next(t for t, d, _ in r if d == 0)
    assert zero_at >= 20 + grace
    assert "scale to zero" in next(reason for t, _, reason in r if t == zero_at)
    assert at(r, 300) == 1  # the first demand brings one replica at once
    assert "scale from zero" in next(reason for t, _, reason in r if t == 300)
    # scale_to_zero off keeps one even with min 0
    off = run(policy, series((0, 300, 0)), **{**s, "scale_to_zero": False})
    assert {d for _, d, _ in off} == {1}


def test_ours_saturation_trigger_follows_a_queue_at_once() -> None:
    s = AutoscaleSettings(**BASE)
    out = {}
    for name in ("concurrency", "kpa"):
        p, state = make_policy(name), ScalerState()
        for t in range(0, 30, 2):  # 70 in flight on 10 replicas: calm
            p.decide(s, state, Observation(at=t, in_flight=70, ready=10, current=10))
        # a rise below the panic threshold, but 10 requests now queue behind full replicas
        out[name] = p.decide(s, state, Observation(at=30, in_flight=90, queued=10, ready=10, current=10))
    assert out["concurrency"].desired == 13 and "saturated" in out["concurrency"].reason  # ceil(100 / 8)
    assert out["kpa"].desired <= 10 and not out["kpa"].panic


def test_settings_validate() -> None:
    with pytest.raises(ValueError, match="max_replicas"):
        AutoscaleSettings(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="panic_window_s"):
        AutoscaleSettings(stable_window_s=10, panic_window_s=20)
    with pytest.raises(ValueError, match="unknown autoscaling policy"):
        make_policy("nope")
    d = run("concurrency", series((0, 4, 8)), **BASE)
    assert d[0][1] == 1
