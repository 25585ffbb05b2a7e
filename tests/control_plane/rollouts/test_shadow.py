"""The shadow phase: comparison statistics, guard verdicts and the state machine around
them, as tables; telemetry keeps copies out of the canary's numbers."""

from __future__ import annotations

import pytest

from control_plane.rollouts.policy import (
    Observation,
    RolloutParams,
    RolloutState,
    canary_target,
    canary_weight,
    decide,
    initial_state,
    operator,
    shadow_share,
)
from control_plane.rollouts.shadow import Comparison, Finished, Greedy, Pair, ShadowGuards, compare, verdict
from control_plane.rollouts.telemetry import UsageWindows
from fleet_base.protocol import UsageRecord


def original(i: int, error: bool = False, ttft: float = 0.1, itl: float = 0.01) -> Finished:
    return Finished(record_id=f"o{i}", error=error, ttft_s=ttft, itl_s=itl)


def copy(
    i: int, error=False, ttft=0.1, itl=0.01, match: bool | None = True, diff: int | None = None
) -> Finished:
    return Finished(
        record_id=f"c{i}",
        error=error,
        ttft_s=ttft,
        itl_s=itl,
        shadow_of=f"o{i}",
        greedy_match=match,
        first_diff_token=diff,
    )


# --------------------------------------------------------------------- statistics


def test_copies_pair_with_their_originals_only() -> None:
    originals = [original(i, ttft=0.1 * (i + 1)) for i in range(10)]
    copies = [copy(i, ttft=0.2 * (i + 1)) for i in range(5)] + [
        Finished("stray", False, 9.0, 9.0, shadow_of="gone")  # its original left the window
    ]
    c = compare(originals, copies, share=0.5)
    assert (c.requests, c.copies, c.compared, c.dropped) == (10, 6, 5, 0)
    # the same five requests on both sides: originals 0.1..0.5, copies 0.2..1.0
    assert c.ttft_p50_s == Pair(original=0.3, copy=0.6)
    assert c.ttft_p90_s == Pair(original=0.5, copy=1.0)


@pytest.mark.parametrize(
    ("copies", "compared", "identical", "agreement", "first_diff_p50"),
    [
        ([copy(0), copy(1), copy(2), copy(3)], 4, 4, 1.0, None),
        ([copy(0), copy(1, match=False, diff=7), copy(2, match=False, diff=3), copy(3)], 4, 2, 0.5, 3.0),
        ([copy(0, match=None), copy(1, match=None)], 0, 0, None, None),  # not greedy: not judged
        ([], 0, 0, None, None),
    ],
)  # fmt: skip
def test_greedy_agreement(copies, compared, identical, agreement, first_diff_p50) -> None:
    g = compare([original(i) for i in range(4)], copies, share=1.0).greedy
    assert (g.compared, g.identical, g.agreement, g.first_diff_token_p50) == (
        compared, identical, agreement, first_diff_p50
    )  # fmt: skip


@pytest.mark.parametrize(
    ("requests", "copies", "share", "dropped"),
    [(100, 10, 0.1, 0), (100, 4, 0.1, 6), (100, 12, 0.1, 0), (0, 0, 0.5, 0), (7, 0, 0.5, 3)],
)
def test_dropped_is_what_the_share_asked_for_but_never_came(requests, copies, share, dropped) -> None:
    c = compare([original(i) for i in range(requests)], [copy(i) for i in range(copies)], share)
    assert c.dropped == dropped


def test_errors_count_on_the_same_requests() -> None:
    c = compare(
        [original(0, error=True), original(1), original(2)],
        [copy(0), copy(1, error=True), copy(2, error=True)],
        1,
    )
    assert (c.errors.original, c.errors.copy_) == (1, 2)
    assert c.as_json()["errors"] == {"original": 1, "copy": 2}


# --------------------------------------------------------------------- guards

GUARDS = ShadowGuards(
    min_requests=10,
    max_error_rate_increase=0.05,
    max_ttft_p90_ratio=1.5,
    max_itl_p90_ratio=1.5,
    min_greedy_agreement=0.9,
)


def comparison(**change) -> Comparison:
    values = dict(
        compared=100,
        errors=Pair(original=1, copy=2),
        ttft_p90_s=Pair(original=0.2, copy=0.25),
        itl_p90_s=Pair(original=0.02, copy=0.02),
        greedy=Greedy(compared=50, identical=49, agreement=0.98),
    )
    return Comparison(**(values | change))


@pytest.mark.parametrize(
    ("change", "ok", "says"),
    [
        ({}, True, "shadow guards held on 100 compared requests, greedy agreement 0.980"),
        ({"compared": 9}, None, "9 of min_requests 10"),
        ({"errors": Pair(original=1, copy=7)}, False, "error rate 0.070 vs 0.010"),
        ({"errors": Pair(original=1, copy=6)}, True, "held"),  # +0.05 exactly: allowed
        ({"ttft_p90_s": Pair(original=0.2, copy=0.31)}, False, "TTFT p90 0.310s is 1.55x"),
        ({"itl_p90_s": Pair(original=0.02, copy=0.04)}, False, "ITL p90 0.040s is 2.00x"),
        ({"itl_p90_s": Pair()}, True, "held"),  # no streams: nothing to judge
        (
            {"greedy": Greedy(compared=50, identical=40, agreement=0.8, first_diff_token_p50=12)},
            False,
            "greedy agreement 40/50 = 0.800 below 0.9 (first difference at token 12",
        ),
        ({"greedy": Greedy()}, True, "shadow guards held on 100 compared requests"),  # nothing greedy
    ],
)  # fmt: skip
def test_verdicts(change, ok, says) -> None:
    got, why = verdict(GUARDS, comparison(**change))
    assert got is ok
    assert says in why


# --------------------------------------------------------------------- the state machine

PARAMS = RolloutParams(
    steps=(10.0, 100.0), shadow_share=0.1, shadow_duration_s=60, shadow_min_requests=10, ready_timeout_s=100
)


def test_a_rollout_with_a_shadow_phase_starts_there() -> None:
    state = initial_state(PARAMS, now=5)
    assert (state.phase, state.shadow) == ("shadowing", "running")
    plain = initial_state(RolloutParams(), now=5)
    assert (plain.phase, plain.shadow) == ("deploying", None)


@pytest.mark.parametrize(
    ("state", "weight", "replicas", "share"),
    [
        (RolloutState(phase="shadowing", shadow="running"), 0.0, 2, None),  # replicas not ready yet
        (RolloutState(phase="shadowing", shadow="running", window_started_at=1), 0.0, 2, 0.1),
        (RolloutState(phase="deploying", shadow="passed"), 0.0, 2, None),
        (RolloutState(phase="observing", shadow="passed", window_started_at=1), 10.0, 2, None),
        (RolloutState(phase="rolled_back", shadow="stopped"), 0.0, 0, None),
    ],
)  # fmt: skip
def test_the_canary_gets_first_step_replicas_and_no_users_while_shadowing(
    state, weight, replicas, share
) -> None:
    assert canary_weight(PARAMS, state) == weight
    assert canary_target(PARAMS, state, total=20) == replicas
    assert shadow_share(PARAMS, state) == share


def obs(now: float, ready: int = 2, **shadow) -> Observation:
    return Observation(now=now, replicas=20, canary_ready=ready, shadow=comparison(**shadow))


@pytest.mark.parametrize(
    ("state", "observation", "action", "phase", "shadow"),
    [
        (RolloutState(phase="shadowing", shadow="running"), obs(10, ready=1), "wait", "shadowing", "running"),
        (RolloutState(phase="shadowing", shadow="running"), obs(10), "shadow_started", "shadowing", "running"),
        (RolloutState(phase="shadowing", shadow="running"), obs(200, ready=1), "shadow_stopped", "rolled_back", "stopped"),
        (RolloutState(phase="shadowing", shadow="running", window_started_at=10), obs(50), "wait", "shadowing", "running"),
        (RolloutState(phase="shadowing", shadow="running", window_started_at=10), obs(70), "shadow_passed", "deploying", "passed"),
        (RolloutState(phase="shadowing", shadow="running", window_started_at=10), obs(70, compared=3), "wait", "shadowing", "running"),
        (
            RolloutState(phase="shadowing", shadow="running", window_started_at=10),
            obs(70, greedy=Greedy(compared=50, identical=10, agreement=0.2)),
            "shadow_stopped",
            "rolled_back",
            "stopped",
        ),
    ],
)  # fmt: skip
def test_shadow_phase_transitions(state, observation, action, phase, shadow) -> None:
    d = decide(PARAMS, state, observation)
    assert (d.action, d.state.phase, d.state.shadow) == (action, phase, shadow)
    if action == "shadow_stopped":
        assert d.state.reason.startswith("stopped in the shadow phase: ")
        assert d.state.shadow_reason
    if action == "shadow_passed":
        assert (d.state.step, d.state.window_started_at) == (0, None)  # canary step 1 begins


def test_copies_never_breach_the_canary_guards_while_shadowing() -> None:
    """The canary answers no user during the phase: its (empty) step numbers decide nothing."""
    state = RolloutState(phase="shadowing", shadow="running", window_started_at=10)
    d = decide(PARAMS, state, obs(20))
    assert d.action == "wait"


def test_an_operator_ends_a_running_shadow_phase() -> None:
    state = RolloutState(phase="shadowing", shadow="running", window_started_at=10)
    assert operator(state, "abort", 20, "ops").shadow == "stopped"
    assert operator(RolloutState(phase="observing", shadow="passed"), "abort", 20, "ops").shadow == "passed"


# --------------------------------------------------------------------- telemetry


def record(**change) -> UsageRecord:
    values = {
        "cluster": "east",
        "key_id": "k",
        "deployment": "web",
        "version": 1,
        "status": 200,
        "ttft_s": 0.1,
    }
    return UsageRecord(**(values | change))


def test_windows_keep_copies_out_of_version_stats_and_pair_them() -> None:
    w = UsageWindows(clock=lambda: 100.0)
    for i in range(4):
        w.add(record(record_id=f"o{i}", itl_s=0.01))
    w.add(record(record_id="c0", version=2, shadow=True, shadow_of="o0", status=500, itl_s=0.03))
    w.add(
        record(record_id="c1", version=2, shadow=True, shadow_of="o1", greedy_match=False, first_diff_token=4)
    )
    w.add(record(record_id="c2", version=3, shadow=True, shadow_of="o2"))  # another version's copy
    assert w.stats("web", 2, since=0).requests == 0  # copies are no canary traffic
    assert w.stats("web", 1, since=0).requests == 4
    c = w.shadow("web", 2, since=0, share=0.5)
    assert (c.requests, c.copies, c.compared, c.errors.copy_, c.errors.original) == (4, 2, 2, 1, 0)
    assert c.itl_p90_s == Pair(original=0.01, copy=0.03)
    assert (c.greedy.compared, c.greedy.identical, c.greedy.first_diff_token_p50) == (1, 0, 4.0)
    assert w.shadow("web", 2, since=101, share=0.5).compared == 0


def test_a_latency_verdict_needs_the_copies_above_the_line_to_be_significant() -> None:
    line = GUARDS.max_ttft_p90_ratio * 0.2
    # a p90 just over the line, from 4 of 30 copies above it: as likely as not by chance
    near = tuple([0.1] * 26 + [line * 1.05] * 4)
    held, why = verdict(GUARDS, comparison(ttft_p90_s=Pair(original=0.2, copy=line * 1.05), copy_ttft_s=near))
    assert held is True, why
    # 15 of 30 above it: the copy's p90 is past the line, not only this sample's
    slow = tuple([0.1] * 15 + [line * 1.5] * 15)
    stopped, why = verdict(
        GUARDS, comparison(ttft_p90_s=Pair(original=0.2, copy=line * 1.5), copy_ttft_s=slow)
    )
    assert stopped is False and "15 of 30 above" in why and "p=" in why


def test_the_copies_samples_are_not_part_of_the_stored_comparison() -> None:
    stored = comparison(copy_ttft_s=(0.1, 0.2), copy_itl_s=(0.01,)).as_json()
    assert "copy_ttft_s" not in stored and "copy_itl_s" not in stored and stored["compared"] == 100
