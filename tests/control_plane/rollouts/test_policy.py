"""The canary policy as a table of situations, plus properties over random telemetry:
it never promotes past a breached guard and never holds more canary replicas than the
current step's share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.rollouts.policy import (
    Observation,
    RolloutParams,
    RolloutState,
    VersionStats,
    baseline_target,
    breach,
    canary_replicas,
    canary_target,
    canary_weight,
    decide,
    operator,
)

P = RolloutParams(
    steps=(10, 50, 100), step_duration_s=10, max_error_rate=0.05, max_ttft_p90_ratio=1.5, min_requests=20
)


def obs(now=100.0, replicas=4, ready=0, canary=(0, 0, None), baseline=(0, 0, None)) -> Observation:
    return Observation(
        now=now,
        replicas=replicas,
        canary_ready=ready,
        canary=VersionStats(requests=canary[0], errors=canary[1], ttft_p90_s=canary[2]),
        baseline=VersionStats(requests=baseline[0], errors=baseline[1], ttft_p90_s=baseline[2]),
    )


@pytest.mark.parametrize(
    "total, percent, want",
    [(4, 5, 1), (4, 25, 1), (4, 26, 2), (4, 50, 2), (4, 100, 4), (1, 5, 1), (0, 50, 0), (10, 0, 0)],
)
def test_canary_gets_replicas_for_its_share(total, percent, want):
    assert canary_replicas(total, percent) == want


def test_baseline_shrinks_only_as_canary_replicas_become_ready():
    assert baseline_target(4, canary_wanted=2, canary_ready=0) == 4
    assert baseline_target(4, canary_wanted=2, canary_ready=1) == 3
    assert baseline_target(4, canary_wanted=2, canary_ready=3) == 2  # extra ready ones do not count
    assert baseline_target(4, canary_wanted=4, canary_ready=4) == 0


def test_deploying_waits_for_replicas_then_opens_the_first_window():
    s = RolloutState(phase_started_at=90.0)
    waiting = decide(P, s, obs(ready=0))
    assert waiting.action == "wait" and "0/1" in waiting.message
    assert canary_weight(P, s) == 0 and canary_target(P, s, 4) == 1
    started = decide(P, s, obs(ready=1))
    assert started.action == "step_started"
    assert started.state.phase == "observing" and started.state.window_started_at == 100.0
    assert canary_weight(P, started.state) == 10 and started.numbers["weight"] == 10


def test_observing_advances_after_duration_and_min_requests_and_promotes_at_the_end():
    s = RolloutState(phase="observing", step=0, phase_started_at=100, window_started_at=100)
    healthy = dict(canary=(25, 0, 0.2), baseline=(200, 1, 0.2), ready=1)
    assert decide(P, s, obs(now=105, **healthy)).action == "wait"  # too early
    few = decide(P, s, obs(now=111, ready=1, canary=(5, 0, 0.2), baseline=(100, 0, 0.2)))
    assert few.action == "wait" and "min_requests" in few.message
    step = decide(P, s, obs(now=111, **healthy))
    assert step.action == "advance" and step.state.phase == "deploying" and step.state.step == 1
    # while step 2's replicas start, traffic stays at step 1's weight and the window continues
    assert canary_weight(P, step.state) == 10 and canary_target(P, step.state, 4) == 2
    last = RolloutState(phase="observing", step=2, phase_started_at=200, window_started_at=200)
    done = decide(P, last, obs(now=211, ready=4, canary=(30, 0, 0.2)))
    assert done.action == "promote" and done.state.phase == "promoted"
    assert canary_weight(P, done.state) == 100 and canary_target(P, done.state, 4) == 4


@pytest.mark.parametrize(
    "canary, baseline, why",
    [
        ((20, 2, 0.2), (100, 0, 0.2), "error rate"),  # 10% > 5% with min_requests met
        ((5, 2, 0.2), (100, 0, 0.2), "error rate"),  # 2 errors > 5% of 20 already: certain
        ((30, 0, 0.4), (100, 0, 0.2), "TTFT p90"),  # 2x the baseline, on enough samples
    ],
)
def test_a_breach_rolls_back_at_once_from_any_phase_with_a_window(canary, baseline, why):
    for s in (
        RolloutState(phase="observing", step=1, window_started_at=100),
        RolloutState(phase="deploying", step=2, window_started_at=100),
    ):
        d = decide(P, s, obs(now=101, ready=1, canary=canary, baseline=baseline))
        assert d.action == "rollback" and d.state.phase == "rolled_back", d
        assert why in d.state.reason and why in d.message
        assert canary_weight(P, d.state) == 0 and canary_target(P, d.state, 4) == 0
        assert d.numbers["canary_requests"] == canary[0]


def test_no_verdict_on_too_little_evidence():
    assert breach(P, obs(canary=(5, 1, 0.2), baseline=(100, 0, 0.2))) is None  # 1 error <= 5% of 20
    assert breach(P, obs(canary=(20, 0, 9.0), baseline=(5, 0, 0.1))) is None  # too few baseline samples
    assert breach(P, obs(canary=(20, 0, 0.29), baseline=(50, 0, 0.2))) is None  # 1.45x < 1.5x


def test_replicas_that_never_get_ready_roll_back():
    s = RolloutState(phase_started_at=0.0)
    late = RolloutParams(steps=(100,), ready_timeout_s=30)
    assert decide(late, s, obs(now=29, ready=0)).action == "wait"
    d = decide(late, s, obs(now=31, ready=0))
    assert d.action == "rollback" and "not ready" in d.state.reason


def test_terminal_states_stay_and_operators_end_rollouts():
    s = RolloutState(phase="observing", window_started_at=0)
    assert operator(s, "promote", 5, "admin").phase == "promoted"
    aborted = operator(s, "abort", 5, "admin")
    assert aborted.phase == "aborted" and "admin" in aborted.reason
    assert decide(P, aborted, obs(canary=(100, 100, 9.0))).action == "wait"


def test_a_slow_p90_on_too_few_canary_samples_is_not_judged_yet():
    # 20 requests meet min_requests, but a p90 of 20 samples is noise: no rollback yet.
    s = RolloutState(phase="observing", step=0, window_started_at=100)
    d = decide(P, s, obs(now=101, ready=1, canary=(20, 0, 0.4), baseline=(100, 0, 0.2)))
    assert d.action != "rollback", d
    assert breach(P, obs(now=101, ready=1, canary=(29, 0, 0.4), baseline=(100, 0, 0.2))) is None
    assert "TTFT p90" in breach(P, obs(now=101, ready=1, canary=(30, 0, 0.4), baseline=(100, 0, 0.2)))


@pytest.mark.parametrize("steps", [(), (50, 25, 100), (5, 50), (0, 100), (5, 5, 100), (101,)])
def test_bad_steps_are_refused(steps):
    with pytest.raises(ValueError):
        RolloutParams(steps=steps)


stats = st.builds(
    lambda n, e, t: VersionStats(requests=n, errors=min(e, n), ttft_p90_s=t if n else None),
    st.integers(0, 500),
    st.integers(0, 500),
    st.floats(0.01, 5),
)


@settings(max_examples=300, deadline=None)
@given(
    phase=st.sampled_from(["deploying", "observing"]),
    step=st.integers(0, 2),
    window=st.booleans(),
    replicas=st.integers(0, 20),
    ready=st.integers(0, 20),
    canary=stats,
    baseline=stats,
    now=st.floats(0, 1000),
)
def test_properties(phase, step, window, replicas, ready, canary, baseline, now):
    s = RolloutState(
        phase=phase,
        step=step,
        phase_started_at=0,
        window_started_at=0.0 if window or phase == "observing" else None,
    )
    o = Observation(now=now, replicas=replicas, canary_ready=ready, canary=canary, baseline=baseline)
    d = decide(P, s, o)
    why = breach(P, o)
    if why is not None and s.window_started_at is not None:
        assert d.action == "rollback"
    if d.action in ("promote", "advance"):
        assert why is None and canary.requests >= P.min_requests
    wanted = canary_target(P, d.state, replicas)
    assert 0 <= wanted <= replicas
    if not d.state.terminal:  # traffic never runs ahead of the replicas asked for it
        assert canary_weight(P, d.state) <= P.steps[d.state.step]
        assert wanted == canary_replicas(replicas, P.steps[d.state.step])
