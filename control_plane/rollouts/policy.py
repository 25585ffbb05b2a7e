"""The canary rollout state machine: plain, synchronous and side-effect free.

`decide(params, state, observation) -> Decision` is the whole policy; the loop feeds it
the persisted state, the canary's ready replicas and the gateway telemetry of the
current window, stores the new state and records the decision as an event.

A rollout may begin with a shadow phase (`shadowing`): the canary gets the replicas of its
first step but no user traffic, gateways copy `shadow_share` of the requests to it, and at
the end of `shadow_duration_s` the comparison of copies with originals
(`control_plane.rollouts.shadow`) either lets it go on to `deploying` step 1 or stops it
(`rolled_back`, the new version never having answered a user).

Phases: `deploying` (the canary gets replicas for step i while traffic stays at step
i-1's weight) -> `observing` (step i's weight applies; guards are checked against the
baseline over the same window) -> `deploying` of step i+1 ... -> `promoted`. A breached
guard at any point with a window open -> `rolled_back`; an operator abort -> `aborted`.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane.rollouts.quantiles import LATENCY_ALPHA, quantile_above
from control_plane.rollouts.shadow import Comparison, ShadowGuards, verdict

Phase = Literal["shadowing", "deploying", "observing", "promoted", "rolled_back", "aborted"]
ShadowPhase = Literal["running", "passed", "stopped"]
TERMINAL: frozenset[str] = frozenset({"promoted", "rolled_back", "aborted"})
Action = Literal[
    "wait",
    "shadow_started",
    "shadow_passed",
    "shadow_stopped",
    "step_started",
    "advance",
    "promote",
    "rollback",
    "abort",
]

DEFAULT_STEPS = (5.0, 25.0, 50.0, 100.0)
MIN_BASELINE_SAMPLES = 10  # baseline requests needed before the TTFT ratio means anything
# Canary requests needed before its TTFT p90 is judged: the p90 of a dozen samples is one of
# the two slowest, and a good canary was rolled back on exactly that noise (1.7x on 12
# requests in a 10% step). Below this the latency guard waits for a later, larger window.
MIN_LATENCY_SAMPLES = 30


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RolloutParams(_Frozen):
    """What an operator chooses per rollout. Steps are percentages of traffic to the
    canary, strictly increasing, ending at 100."""

    steps: tuple[float, ...] = DEFAULT_STEPS
    step_duration_s: float = Field(120.0, gt=0, le=86_400)
    max_error_rate: float = Field(0.02, ge=0, le=1)
    max_ttft_p90_ratio: float = Field(1.3, gt=0, le=1000)
    min_requests: int = Field(50, ge=0, le=10_000_000)
    ready_timeout_s: float = Field(600.0, gt=0, le=86_400)
    # The shadow phase (None: none) and its guards, judged at its end on copies vs originals.
    shadow_share: float | None = Field(None, gt=0, le=1)
    shadow_duration_s: float = Field(600.0, gt=0, le=86_400)
    shadow_min_requests: int = Field(20, ge=1, le=10_000_000)
    shadow_max_error_rate_increase: float = Field(0.02, ge=0, le=1)
    shadow_max_ttft_p90_ratio: float = Field(1.5, gt=0, le=1000)
    shadow_max_itl_p90_ratio: float = Field(1.5, gt=0, le=1000)
    shadow_min_greedy_agreement: float = Field(0.9, ge=0, le=1)

    def shadow_guards(self) -> ShadowGuards:
        return ShadowGuards(
            min_requests=self.shadow_min_requests,
            max_error_rate_increase=self.shadow_max_error_rate_increase,
            max_ttft_p90_ratio=self.shadow_max_ttft_p90_ratio,
            max_itl_p90_ratio=self.shadow_max_itl_p90_ratio,
            min_greedy_agreement=self.shadow_min_greedy_agreement,
        )

    @field_validator("steps")
    @classmethod
    def _steps(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if not steps:
            raise ValueError("at least one step is needed")
        if len(steps) > 20:
            raise ValueError("at most 20 steps")
        if any(not 0 < s <= 100 for s in steps):
            raise ValueError("every step must be a percentage in (0, 100]")
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError("steps must increase strictly")
        if steps[-1] != 100:
            raise ValueError("the last step must be 100 (the canary takes all traffic before promotion)")
        return steps


class RolloutState(_Frozen):
    phase: Phase = "deploying"
    step: int = Field(0, ge=0)
    phase_started_at: float = 0.0  # deploying: the clock of the readiness timeout
    window_started_at: float | None = None  # start of the telemetry window (None: no canary traffic yet)
    reason: str = ""
    shadow: ShadowPhase | None = None  # None: the rollout has no shadow phase
    shadow_reason: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


class VersionStats(_Frozen):
    """One version's finished requests in a window."""

    requests: int = 0
    errors: int = 0  # status >= 500
    ttft_p90_s: float | None = None
    # the window's TTFTs, for the latency guard's significance (empty: judged on the p90 alone)
    ttft_samples_s: tuple[float, ...] = Field((), repr=False)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None


class Observation(_Frozen):
    now: float
    replicas: int = Field(ge=0)  # the deployment's desired count
    canary_ready: int = Field(0, ge=0)
    canary: VersionStats = Field(default_factory=VersionStats)
    baseline: VersionStats = Field(default_factory=VersionStats)
    shadow: Comparison = Field(default_factory=Comparison)


Number = float | int | str | None


class Decision(_Frozen):
    state: RolloutState
    action: Action
    message: str
    numbers: dict[str, Number] = Field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.action != "wait"


# --------------------------------------------------------------------- capacity and weights


def canary_replicas(total: int, percent: float) -> int:
    """Replicas the canary needs for `percent` of the traffic: its share of the total,
    at least one while it gets any traffic, never more than the total."""
    if percent <= 0 or total <= 0:
        return 0
    return min(total, max(1, math.ceil(total * percent / 100 - 1e-9)))


def canary_weight(params: RolloutParams, state: RolloutState) -> float:
    """Percent of traffic routed to the canary now: step i's weight once observing, the
    previous step's while step i's replicas start."""
    if state.phase == "promoted":
        return 100.0
    if state.phase in TERMINAL or state.phase == "shadowing":
        return 0.0
    if state.phase == "observing":
        return params.steps[state.step]
    return params.steps[state.step - 1] if state.step > 0 else 0.0


def canary_target(params: RolloutParams, state: RolloutState, total: int) -> int:
    """Canary replicas wanted now (the placer adds them; the baseline shrinks only as they
    become ready, so the fleet never holds more than total + one step's canary)."""
    if state.phase == "promoted":
        return total
    if state.phase in TERMINAL:
        return 0
    return canary_replicas(total, params.steps[state.step])


def initial_state(params: RolloutParams, now: float) -> RolloutState:
    """A new rollout: its shadow phase first when it has one."""
    if params.shadow_share is not None:
        return RolloutState(phase="shadowing", phase_started_at=now, shadow="running")
    return RolloutState(phase="deploying", phase_started_at=now)


def shadow_share(params: RolloutParams, state: RolloutState) -> float | None:
    """The share of requests gateways copy to the canary now (None: no copies): only while
    the shadow phase runs and its window is open (the canary's replicas are ready)."""
    if state.phase != "shadowing" or state.window_started_at is None:
        return None
    return params.shadow_share


def baseline_target(total: int, canary_wanted: int, canary_ready: int) -> int:
    """Baseline replicas wanted: the total less the canary replicas already ready."""
    return max(0, total - min(canary_wanted, canary_ready))


# --------------------------------------------------------------------- guards


def _numbers(params: RolloutParams, state: RolloutState, obs: Observation) -> dict[str, Number]:
    ratio = ttft_ratio(obs)
    return {
        "step": state.step + 1,
        "steps": len(params.steps),
        "weight": canary_weight(params, state),
        "canary_requests": obs.canary.requests,
        "canary_errors": obs.canary.errors,
        "canary_error_rate": _round(obs.canary.error_rate),
        "baseline_requests": obs.baseline.requests,
        "baseline_error_rate": _round(obs.baseline.error_rate),
        "canary_ttft_p90_s": _round(obs.canary.ttft_p90_s),
        "baseline_ttft_p90_s": _round(obs.baseline.ttft_p90_s),
        "ttft_p90_ratio": _round(ratio),
        "ttft_p_value": _round(ttft_p_value(params, obs)),
        "canary_ready": obs.canary_ready,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def ttft_ratio(obs: Observation) -> float | None:
    c, b = obs.canary.ttft_p90_s, obs.baseline.ttft_p90_s
    if c is None or b is None or b <= 0 or obs.baseline.requests < MIN_BASELINE_SAMPLES:
        return None
    return c / b


def ttft_p_value(params: RolloutParams, obs: Observation) -> float | None:
    """How likely the canary's TTFTs above `max_ttft_p90_ratio` x the baseline's p90 would be
    were its true p90 on that line (None: no baseline p90 yet, or no samples to judge)."""
    b = obs.baseline.ttft_p90_s
    samples = obs.canary.ttft_samples_s
    if b is None or not samples or obs.baseline.requests < MIN_BASELINE_SAMPLES:
        return None
    return quantile_above(samples, params.max_ttft_p90_ratio * b, 0.9)[1]


def breach(params: RolloutParams, obs: Observation) -> str | None:
    """Why the canary fails its guards in this window, or None.

    Error rate: judged once `min_requests` canary requests finished, or earlier when the
    errors already seen exceed what `max_error_rate` allows at `min_requests` (the verdict
    cannot change any more). TTFT p90: canary / baseline over the same window, once the
    canary has `MIN_LATENCY_SAMPLES` (and `min_requests`) and the baseline
    `MIN_BASELINE_SAMPLES`, and only when the canary's samples above the line are
    significant (`LATENCY_ALPHA`): a p90 a hair over the line on 40 requests is noise."""
    c = obs.canary
    allowed_at_min = params.max_error_rate * params.min_requests
    if c.requests and (
        (c.requests >= params.min_requests and (c.error_rate or 0.0) > params.max_error_rate)
        or (c.errors > allowed_at_min and c.errors > 0 and c.requests < params.min_requests)
    ):
        return (
            f"canary error rate {c.errors}/{c.requests} = {c.error_rate:.3f} exceeds "
            f"max_error_rate {params.max_error_rate:g}"
        )
    ratio = ttft_ratio(obs)
    enough = c.requests >= max(MIN_LATENCY_SAMPLES, params.min_requests)
    if ratio is None or not enough or ratio <= params.max_ttft_p90_ratio:
        return None
    why = (
        f"canary TTFT p90 {c.ttft_p90_s:.3f}s is {ratio:.2f}x the baseline's "
        f"{obs.baseline.ttft_p90_s:.3f}s (max {params.max_ttft_p90_ratio:g}x)"
    )
    p_value = ttft_p_value(params, obs)
    if p_value is None:
        return why
    if p_value >= LATENCY_ALPHA:
        return None
    line = params.max_ttft_p90_ratio * (obs.baseline.ttft_p90_s or 0.0)
    above = quantile_above(c.ttft_samples_s, line, 0.9)[0]
    return f"{why}; {above} of {len(c.ttft_samples_s)} above {line:.3f}s, p={p_value:.2g}"


# --------------------------------------------------------------------- the state machine


def decide(params: RolloutParams, state: RolloutState, obs: Observation) -> Decision:
    """The next state of a rollout given what was observed; `action == "wait"` means no change."""
    numbers = _numbers(params, state, obs)
    if state.terminal:
        return Decision(state=state, action="wait", message=f"rollout {state.phase}", numbers=numbers)
    if state.phase == "shadowing":
        return _shadowing(params, state, obs, numbers)
    if state.window_started_at is not None:
        why = breach(params, obs)
        if why is not None:
            new = state.model_copy(
                update={"phase": "rolled_back", "phase_started_at": obs.now, "reason": why}
            )
            return Decision(
                state=new,
                action="rollback",
                message=f"rolled back at step {state.step + 1} ({canary_weight(params, state):g}%): {why}",
                numbers=numbers,
            )
    if state.phase == "deploying":
        need = canary_target(params, state, obs.replicas)
        if obs.canary_ready >= need:
            new = state.model_copy(
                update={"phase": "observing", "phase_started_at": obs.now, "window_started_at": obs.now}
            )
            numbers = {**numbers, "weight": canary_weight(params, new)}
            return Decision(
                state=new,
                action="step_started",
                message=(
                    f"step {state.step + 1}/{len(params.steps)}: canary at {params.steps[state.step]:g}% "
                    f"of traffic on {obs.canary_ready} ready replica(s)"
                ),
                numbers=numbers,
            )
        waited = obs.now - state.phase_started_at
        if waited > params.ready_timeout_s:
            why = f"canary replicas not ready after {waited:.0f}s ({obs.canary_ready}/{need} ready)"
            new = state.model_copy(
                update={"phase": "rolled_back", "phase_started_at": obs.now, "reason": why}
            )
            return Decision(state=new, action="rollback", message=f"rolled back: {why}", numbers=numbers)
        return Decision(
            state=state,
            action="wait",
            message=f"waiting for canary replicas ({obs.canary_ready}/{need} ready)",
            numbers=numbers,
        )
    # observing
    assert state.window_started_at is not None
    elapsed = obs.now - state.window_started_at
    if elapsed < params.step_duration_s:
        return Decision(
            state=state,
            action="wait",
            message=f"observing step {state.step + 1}: {elapsed:.0f}s of {params.step_duration_s:g}s",
            numbers=numbers,
        )
    if obs.canary.requests < params.min_requests:
        return Decision(
            state=state,
            action="wait",
            message=(
                f"step {state.step + 1} waits for traffic: {obs.canary.requests} of "
                f"min_requests {params.min_requests} canary requests"
            ),
            numbers=numbers,
        )
    if state.step + 1 >= len(params.steps):
        new = state.model_copy(
            update={"phase": "promoted", "phase_started_at": obs.now, "reason": "all steps passed"}
        )
        return Decision(
            state=new,
            action="promote",
            message=f"promoted after {len(params.steps)} step(s): every guard held",
            numbers=numbers,
        )
    new = state.model_copy(update={"phase": "deploying", "step": state.step + 1, "phase_started_at": obs.now})
    return Decision(
        state=new,
        action="advance",
        message=(
            f"step {state.step + 1} passed; scaling the canary for {params.steps[state.step + 1]:g}% "
            f"({canary_target(params, new, obs.replicas)} replica(s))"
        ),
        numbers=numbers,
    )


def _shadowing(
    params: RolloutParams, state: RolloutState, obs: Observation, numbers: dict[str, Number]
) -> Decision:
    """The shadow phase: wait for the canary's first-step replicas, copy for
    `shadow_duration_s`, then judge the comparison."""
    numbers = {**numbers, "shadow_share": params.shadow_share}
    if state.window_started_at is None:
        need = canary_replicas(obs.replicas, params.steps[0])
        if obs.canary_ready >= need:
            new = state.model_copy(update={"phase_started_at": obs.now, "window_started_at": obs.now})
            return Decision(
                state=new,
                action="shadow_started",
                message=(
                    f"shadow phase: {params.shadow_share:.0%} of requests copied to the canary on "
                    f"{obs.canary_ready} ready replica(s) for {params.shadow_duration_s:g}s"
                ),
                numbers=numbers,
            )
        waited = obs.now - state.phase_started_at
        if waited > params.ready_timeout_s:
            why = f"canary replicas not ready after {waited:.0f}s ({obs.canary_ready}/{need} ready)"
            return _stopped(state, obs, why, numbers)
        return Decision(
            state=state,
            action="wait",
            message=f"shadow phase waits for canary replicas ({obs.canary_ready}/{need} ready)",
            numbers=numbers,
        )
    elapsed = obs.now - state.window_started_at
    if elapsed < params.shadow_duration_s:
        return Decision(
            state=state,
            action="wait",
            message=f"shadow phase: {elapsed:.0f}s of {params.shadow_duration_s:g}s, {obs.shadow.compared} compared",
            numbers=numbers,
        )
    ok, why = verdict(params.shadow_guards(), obs.shadow)
    if ok is None:
        return Decision(
            state=state, action="wait", message=f"shadow phase waits for traffic: {why}", numbers=numbers
        )
    if not ok:
        return _stopped(state, obs, why, numbers)
    new = state.model_copy(
        update={
            "phase": "deploying",
            "step": 0,
            "phase_started_at": obs.now,
            "window_started_at": None,
            "shadow": "passed",
            "shadow_reason": why,
        }
    )
    return Decision(
        state=new,
        action="shadow_passed",
        message=f"shadow phase passed ({why}); canary steps begin",
        numbers=numbers,
    )


def _stopped(state: RolloutState, obs: Observation, why: str, numbers: dict[str, Number]) -> Decision:
    reason = f"stopped in the shadow phase: {why}"
    new = state.model_copy(
        update={
            "phase": "rolled_back",
            "phase_started_at": obs.now,
            "reason": reason,
            "shadow": "stopped",
            "shadow_reason": why,
        }
    )
    return Decision(
        state=new,
        action="shadow_stopped",
        message=f"{reason} (the new version never served users)",
        numbers=numbers,
    )


def operator(state: RolloutState, action: Literal["promote", "abort"], now: float, who: str) -> RolloutState:
    """A rollout ended by hand (a running shadow phase ends with it, unjudged)."""
    done = "promoted" if action == "promote" else "aborted"
    update: dict = {"phase": done, "phase_started_at": now, "reason": f"{done} by {who}"}
    if state.phase == "shadowing":
        update |= {"shadow": "stopped", "shadow_reason": f"{done} by {who}"}
    return state.model_copy(update=update)
