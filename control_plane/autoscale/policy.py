"""Autoscaling policies: plain, synchronous, side-effect free (the one thing a decision
changes is the `ScalerState` it is handed: its sliding windows). The same objects run in
the control plane's autoscale loop and in `fleetctl simulate`.

Knative-like (KPA): demand is requests in flight and queued, summed over clusters.
- stable demand: its mean over `stable_window_s`; panic demand: over `panic_window_s`;
- desired = ceil(demand / (target_concurrency x target_utilization)), within min..max;
- panic: when the panic window wants `panic_threshold` x the ready replicas, follow it at
  once and never scale down until the panic has been over for a stable window;
- scale up at once; scale down only to the highest desired count of the last
  `scale_down_delay_s`; rate of change bounded by `max_scale_up_rate` and
  `max_scale_down_rate` (factors of the ready count per decision);
- no scale-down before one stable window of observations (a fresh or restarted
  autoscaler has not seen the demand yet);
- scale to zero (min 0 and `scale_to_zero`) only after `scale_to_zero_grace_s` without
  any demand; from zero: one replica at once when demand appears.

Policies here: `kpa` (the algorithm with Knative's defaults for its windows, delay and rates),
`concurrency` (the previous default: the same algorithm with a scale-down delay, a longer scale-to-zero grace, and a saturation
trigger: while requests queue, the demand of this tick counts, not only the windows' means), `static` (always the
maximum). The default, `ours`, is the SLO-driven `slo` policy (`control_plane.autoscale.slo`);
`planner` follows Dynamo's SLA planner (`control_plane.autoscale.planner`). Every decision
is a `Decision` with the reason in words.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from control_plane.autoscale.capacity import Variant
from fleet_base.engines import EngineKind
from fleet_base.named_registry import Registry
from fleet_base.profile import PerfProfile

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_ITL_S = 0.1
# A live version that leaves `scale_down_delay_s` unset (null): a policy that
# `derives_scale_down_delay` (the SLO policy: one cold start plus a stable window,
# `slo.scale_down_delay`) is handed null; every other policy, and the SLO policy's concurrency
# fallback without a profile, holds for this long: every version's delay before it could be
# left unset, so their live behaviour is unchanged. `fleetctl simulate` replays settings, not
# versions: there, unset is each policy's own `Tuning` default.
UNSET_SCALE_DOWN_DELAY_S = 300.0


class AutoscaleSettings(BaseModel):
    """Per deployment version (JSON in `DeploymentVersion.autoscaling`); None means the
    policy's own default."""

    model_config = ConfigDict(extra="forbid")

    policy: str = "ours"
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(10, ge=0, le=1000)
    target_concurrency: float = Field(16.0, gt=0, description="requests per replica")
    target_utilization: float | None = Field(None, gt=0, le=1)
    stable_window_s: float | None = Field(None, gt=0, le=3600)
    panic_window_s: float | None = Field(None, gt=0, le=3600)
    panic_threshold: float | None = Field(None, ge=1)
    scale_down_delay_s: float | None = Field(None, ge=0, le=3600)
    max_scale_up_rate: float | None = Field(None, gt=1)
    max_scale_down_rate: float | None = Field(None, gt=1)
    scale_to_zero: bool = True
    scale_to_zero_grace_s: float | None = Field(None, ge=0, le=3600)
    # SLO-driven policies (`slo`, `planner`): the targets, and what a replica can do.
    slo_ttft_s: float = Field(DEFAULT_SLO_TTFT_S, gt=0, le=3600, description="time to first token")
    slo_itl_s: float = Field(DEFAULT_SLO_ITL_S, gt=0, le=60, description="mean inter-token latency")
    profile: PerfProfile | None = Field(None, exclude=True, description="one replica's performance")
    # The server its replicas run (fleet_base.engines): profiles are measured per engine, so
    # whoever picks or reads one sees which engine the numbers must describe.
    engine: EngineKind = "fleet"
    variants: list[Variant] = Field(default_factory=list, exclude=True, description="GPU types / tiers")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        if self.stable_window_s is not None and self.panic_window_s is not None:
            if self.panic_window_s > self.stable_window_s:
                raise ValueError("panic_window_s must be <= stable_window_s")
        return self


@dataclass(frozen=True)
class Tuning:
    """A policy's defaults for the knobs a deployment leaves unset."""

    target_utilization: float
    stable_window_s: float
    panic_window_s: float
    panic_threshold: float
    scale_down_delay_s: float
    max_scale_up_rate: float
    max_scale_down_rate: float
    scale_to_zero_grace_s: float
    saturation_trigger: bool = False


# Knative Serving's defaults (config-autoscaler): 70 % utilization, 60 s stable window,
# panic window 10 % of it, panic at 200 %, no scale-down delay, rates 1000 and 2.
KPA_TUNING = Tuning(0.7, 60.0, 6.0, 2.0, 0.0, 1000.0, 2.0, 30.0)
# Ours: Knative's windows and utilization, plus a 90 s scale-down delay (a replica that
# took a minute to start is not given back on a dip) and the saturation trigger. Chosen
# on the Azure conversation trace with the Llama2-70B H100 profile (docs/autoscaling.md).
OURS_TUNING = Tuning(0.7, 60.0, 6.0, 2.0, 90.0, 1000.0, 2.0, 60.0, saturation_trigger=True)


@dataclass(frozen=True)
class Observation:
    """One tick's view of a deployment, summed over clusters."""

    at: float
    in_flight: float  # running on replicas
    queued: float = 0.0  # waiting on replicas and in gateway queues
    ready: int = 0
    starting: int = 0
    current: int = 0  # replicas wanted now (Deployment.replicas)
    # Work, for the SLO-driven policies (0 / None: not reported).
    requests_per_s: float = 0.0  # arriving
    prompt_tokens_per_s: float = 0.0  # arriving (or admitted, where arrivals are not seen)
    output_tokens_per_s: float = 0.0  # generated
    kv_usage: float = 0.0  # mean over ready replicas, 0..1
    ttft_s: float | None = None  # observed mean TTFT of the last interval
    itl_s: float | None = None  # observed mean inter-token latency of the last interval
    prompt_sample: tuple[int, ...] = ()  # prompt lengths of some requests that arrived (the mix)
    cold_start_s: float | None = None  # measured by the agents (their replicas' latest starts)

    @property
    def demand(self) -> float:
        return self.in_flight + self.queued


@dataclass(frozen=True)
class Decision:
    desired: int
    current: int
    reason: str
    stable_demand: float = 0.0
    panic_demand: float = 0.0
    panic: bool = False
    mix: dict[str, int] = field(default_factory=dict)  # variant -> replicas (empty: any)
    predicted: dict[str, object] = field(default_factory=dict)  # the model's view, for the record

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def as_dict(self) -> dict[str, object]:
        return {
            "desired": self.desired,
            "current": self.current,
            "reason": self.reason,
            "stable_demand": round(self.stable_demand, 3),
            "panic_demand": round(self.panic_demand, 3),
            "panic": self.panic,
            **({"mix": dict(self.mix)} if self.mix else {}),
            **({"predicted": self.predicted} if self.predicted else {}),
        }


@dataclass
class ScalerState:
    """The windows of one deployment: demand samples, recent desired counts, panic."""

    samples: deque[tuple[float, float]] = field(default_factory=deque)
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    panic_until: float = -math.inf
    last_demand_at: float = -math.inf
    first_at: float | None = None  # the first observation: no scale-down before a full window
    memory: dict[str, object] = field(default_factory=dict)  # a policy's own state, by policy


class AutoscalePolicy(Protocol):
    name: str
    derives_scale_down_delay: bool  # an unset delay is its own to derive (UNSET_SCALE_DOWN_DELAY_S)

    def decide(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision: ...


def window_mean(samples: deque[tuple[float, float]], since: float) -> float:
    values = [v for t, v in samples if t > since]
    return sum(values) / len(values) if values else 0.0


class KnativeLike:
    """The KPA algorithm above, with `tuning` for the knobs a deployment leaves unset."""

    derives_scale_down_delay = False

    def __init__(self, name: str, tuning: Tuning) -> None:
        self.name = name
        self.tuning = tuning

    def knob(self, settings: AutoscaleSettings, key: str) -> float:
        value = getattr(settings, key)
        return float(getattr(self.tuning, key) if value is None else value)

    def decide(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision:
        k = lambda key: self.knob(settings, key)  # noqa: E731
        t, stable_w, panic_w = obs.at, k("stable_window_s"), k("panic_window_s")
        state.samples.append((t, obs.demand))
        if state.first_at is None:
            state.first_at = t
        while state.samples and state.samples[0][0] <= t - stable_w:
            state.samples.popleft()
        if obs.demand > 0:
            state.last_demand_at = t
        per_replica = settings.target_concurrency * k("target_utilization")
        stable = window_mean(state.samples, t - stable_w)
        panic_demand = window_mean(state.samples, t - panic_w)
        want_stable = math.ceil(stable / per_replica - 1e-9)
        want_panic = math.ceil(panic_demand / per_replica - 1e-9)
        ready = obs.ready
        base = max(ready, 1)

        reasons: list[str] = []
        if want_panic > ready and want_panic >= k("panic_threshold") * base:
            if t >= state.panic_until:
                reasons.append(f"panic: {panic_demand:.1f} in flight over {panic_w:g}s wants {want_panic}")
            state.panic_until = t + stable_w
        panic = t < state.panic_until
        if panic:
            desired = max(want_panic, want_stable, obs.current)
            if not reasons:
                reasons.append(f"panic mode (until {state.panic_until - t:.0f}s from now): no scale-down")
        else:
            desired = want_stable
            reasons.append(
                f"stable demand {stable:.1f} over {stable_w:g}s / {per_replica:g} per replica -> {desired}"
            )

        if self.tuning.saturation_trigger and obs.queued > 0:
            instant = math.ceil(obs.demand / per_replica - 1e-9)
            if instant > desired:
                desired = instant
                reasons.append(f"saturated: {obs.queued:g} queued, {obs.demand:g} in flight now -> {desired}")

        desired = hold_scale_down(state, obs, desired, k("scale_down_delay_s"), stable_w, reasons)
        # Rates of change, relative to the ready replicas.
        up_limit = math.ceil(k("max_scale_up_rate") * base)
        if desired > up_limit:
            desired = up_limit
            reasons.append(f"scale-up rate bounds it to {up_limit}")
        desired = limit_scale_down(obs, desired, k("max_scale_down_rate"), reasons)
        desired = guard_zero(settings, state, obs, desired, k("scale_to_zero_grace_s"), reasons)

        bounded = min(max(desired, settings.min_replicas), settings.max_replicas)
        if bounded != desired:
            reasons.append(
                f"bounded to {bounded} by min {settings.min_replicas} / max {settings.max_replicas}"
            )
        return Decision(bounded, obs.current, "; ".join(reasons), stable, panic_demand, panic)


def hold_scale_down(
    state: ScalerState, obs: Observation, desired: int, delay_s: float, window_s: float, reasons: list[str]
) -> int:
    """Scale down only to the highest desired count of the delay window, and not at all
    before one full window of demand (a restart must not scale down on a blind spot)."""
    t = obs.at
    state.recent.append((t, desired))
    while state.recent and state.recent[0][0] < t - delay_s:
        state.recent.popleft()
    held = max(d for _, d in state.recent)
    if held > desired:
        desired = held
        reasons.append(f"held at {held} by the {delay_s:g}s scale-down delay")
    if state.first_at is not None and t - state.first_at < window_s and desired < obs.current:
        desired = obs.current
        reasons.append(f"no scale-down before a full {window_s:g}s window of demand")
    return desired


def limit_scale_down(obs: Observation, desired: int, max_rate: float, reasons: list[str]) -> int:
    """At most a `max_rate` factor down from the ready replicas in one decision."""
    down_limit = math.floor(obs.ready / max_rate)
    if desired < down_limit and desired < obs.current:
        desired = min(obs.current, down_limit)
        reasons.append(f"scale-down rate bounds it to {desired}")
    return desired


def guard_zero(
    settings: AutoscaleSettings,
    state: ScalerState,
    obs: Observation,
    desired: int,
    grace_s: float,
    reasons: list[str],
) -> int:
    """Zero only when allowed and idle for the grace period; never zero with demand."""
    t = obs.at
    if desired == 0:
        if settings.min_replicas > 0 or not settings.scale_to_zero:
            desired = max(1, settings.min_replicas)
        elif t - state.last_demand_at < grace_s:
            desired = 1
            reasons.append(f"idle for {max(0.0, t - state.last_demand_at):.0f}s of {grace_s:g}s before zero")
        else:
            reasons.append(f"scale to zero: no demand for {grace_s:g}s")
    if obs.demand > 0 and desired == 0:
        desired = 1
    if obs.demand > 0 and obs.current == 0 and obs.ready == 0:
        reasons.append("scale from zero: demand with no replica")
    return desired


class Static:
    """Always `max_replicas` (provisioned for the peak)."""

    name = "static"
    derives_scale_down_delay = False

    def decide(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision:
        return Decision(settings.max_replicas, obs.current, f"static: {settings.max_replicas} replicas")


POLICIES: Registry[AutoscalePolicy] = Registry(
    "autoscaling policy",
    {
        # `ours` (the default) and `slo` register from control_plane.autoscale.slo, `planner`
        # from control_plane.autoscale.planner.
        "concurrency": lambda: KnativeLike("concurrency", OURS_TUNING),
        "kpa": lambda: KnativeLike("kpa", KPA_TUNING),
        "static": Static,
    },
)


def register_policy(name: str, factory: Callable[[], AutoscalePolicy]) -> None:
    POLICIES.register(name, factory)


def make_policy(name: str) -> AutoscalePolicy:
    return POLICIES.make(name)


def version_scale_down_delay(value: float | None, policy: AutoscalePolicy) -> float | None:
    """A version's delay as `policy` takes it: the version's own, else null for a policy that
    derives it, else UNSET_SCALE_DOWN_DELAY_S."""
    if value is not None:
        return float(value)
    return None if getattr(policy, "derives_scale_down_delay", False) else UNSET_SCALE_DOWN_DELAY_S
