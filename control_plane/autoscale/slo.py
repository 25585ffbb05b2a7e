"""The `slo` policy (the default, as `ours`): replicas sized by work against latency
targets, not by requests in flight.

Every decision:
1. load: requests/s, prompt tokens/s and output tokens/s, smoothed with a trend (Holt),
   forecast one cold start ahead (what a replica asked for now must already carry), never
   below the current level; requests queued anywhere add the rate that drains them over
   that horizon;
2. feedback: the observed mean TTFT against the model's own prediction for the ready
   replicas at the current load gives a correction factor on service times (bounded,
   smoothed), so a profile that is wrong for this workload is corrected live;
3. desired: for each variant (GPU type / tier; one when the deployment has one), the
   smallest count whose predicted TTFT and ITL at the predicted load meet `slo_ttft_s`
   and `slo_itl_s` (`capacity.ReplicaCapacity`); across variants the cheapest mix that
   meets them (`mix`);
4. a floor: requests in flight and queued (their mean over the panic window, or over the
   stable window when higher) over `target_concurrency` per replica: the deployment's cap
   on a replica's batch;
5. the same guards as the Knative-like policies: the highest desired count of the last
   `scale_down_delay_s`, no scale-down before one stable window, scale-down at most by
   `max_scale_down_rate`, scale to zero after a grace without demand and back at once.

A deployment without a profile has no capacity model: it is scaled by the concurrency
policy (`concurrency`) and the decision says so."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from control_plane.autoscale.burst import BurstMemory, BurstView
from control_plane.autoscale.capacity import Load, Prediction, ReplicaCapacity, Variant
from control_plane.autoscale.forecast import Holt
from control_plane.autoscale.policy import (
    OURS_TUNING,
    UNSET_SCALE_DOWN_DELAY_S,
    AutoscaleSettings,
    Decision,
    KnativeLike,
    Observation,
    ScalerState,
    guard_zero,
    hold_scale_down,
    limit_scale_down,
    window_mean,
)
from control_plane.autoscale.seasonal import Seasons
from fleet_base.quantiles import evenly_spaced

# Of the requests whose own prefill fits the TTFT target (the attainable ones), at most
# this share of all requests may be predicted to miss it by waiting.
MISS_BUDGET = 0.01
SAMPLE_S = 60.0  # prompt lengths remembered for the mix
SAMPLE_MAX = 64
CORRECTION_BOUNDS = (0.5, 2.0)
CORRECTION_S = 60.0  # smoothing time constant of the correction


@dataclass
class SloMemory:
    requests: Holt = field(default_factory=Holt)
    prompt: Holt = field(default_factory=Holt)
    output: Holt = field(default_factory=Holt)
    correction: float = 1.0
    corrected_at: float | None = None
    prompts: deque[tuple[float, int]] = field(default_factory=deque)
    burst: BurstMemory = field(default_factory=BurstMemory)
    seasons: Seasons = field(default_factory=Seasons)

    def remember(self, t: float, sample: tuple[int, ...]) -> None:
        self.prompts.extend((t, x) for x in sample)
        while self.prompts and self.prompts[0][0] < t - SAMPLE_S:
            self.prompts.popleft()
        while len(self.prompts) > 4 * SAMPLE_MAX:
            self.prompts.popleft()

    def mix(self) -> list[int]:
        """Up to SAMPLE_MAX evenly spaced quantiles of the remembered lengths, whatever order
        they came in (a heartbeat's arrive sorted)."""
        values = sorted(x for _, x in self.prompts)
        return evenly_spaced(((x, 1.0) for x in values), min(len(values), SAMPLE_MAX))


def meets(p: Prediction, settings: AutoscaleSettings) -> bool:
    """The prediction meets the targets: finite queues, ITL within target, and all but
    MISS_BUDGET of the requests that can meet the TTFT target at all predicted to."""
    if not p.feasible or p.itl_s > settings.slo_itl_s:
        return False
    return p.attainment >= p.attainable - MISS_BUDGET


def smallest(
    cap: ReplicaCapacity,
    load: Load,
    settings: AutoscaleSettings,
    limit: int,
    correction: float,
    prompts: list[int],
) -> tuple[int, Prediction]:
    """The smallest replica count in 1..limit meeting the targets (or `limit`, with its
    prediction, when none does). Predictions improve with the count."""
    predict = lambda n: cap.predict(load, n, correction, prompts, settings.slo_ttft_s)  # noqa: E731
    limit = max(1, limit)
    # Below `lo` no count can do: prefill at its best batching, or decode at its full batch,
    # would need more than all of the replicas' time. Gallop up from there, then bisect.
    prompt = max(1.0, load.mean_prefill)
    best_prefill = cap.prefill_cost(prompt, load.requests_per_s, correction)
    best_decode = cap.decode_rate(cap.batch_limit, correction)
    decode = load.requests_per_s * max(0.0, load.mean_output - 1)
    need = max(load.requests_per_s * best_prefill, decode / best_decode)
    lo = min(limit, max(1, math.ceil(need - 1e-9)))
    step, hi = 1, lo
    while not meets(found := predict(hi), settings):
        if hi >= limit:
            return limit, found
        lo, hi = hi + 1, min(limit, hi + step)
        step *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(predict(mid), settings):
            hi = mid
        else:
            lo = mid + 1
    return hi, predict(hi)


def cheapest_mix(
    variants: list[Variant], load: Load, settings: AutoscaleSettings, correction: float, prompts: list[int]
) -> tuple[dict[str, int], Prediction, list[str]]:
    """Greedy over variants by the cost of carrying the whole load on one: fill the
    cheapest up to its pools' room; the rest of the load (in proportion) goes to the next."""
    caps = {v.name: ReplicaCapacity(v.profile) for v in variants}
    alone = {}
    for v in variants:
        n, pred = smallest(caps[v.name], load, settings, settings.max_replicas, correction, prompts)
        alone[v.name] = (n * v.hourly_price, n, pred)
    order = sorted(variants, key=lambda v: (alone[v.name][0], v.name))
    mix: dict[str, int] = {}
    notes: list[str] = []
    share_left = 1.0
    first: Prediction | None = None
    for v in order:
        if share_left <= 1e-9:
            break
        part = load.scaled(share_left)
        if share_left == 1.0:
            n, pred = alone[v.name][1], alone[v.name][2]
        else:
            n, pred = smallest(caps[v.name], part, settings, settings.max_replicas, correction, prompts)
        room = v.max_replicas if v.max_replicas is not None else n
        take = min(n, room)
        if take <= 0:
            notes.append(f"{v.name}: no room")
            continue
        mix[v.name] = take
        notes.append(f"{take} x {v.name} (${v.hourly_price:g}/h each)")
        if first is None:
            first = (
                pred
                if take == n
                else caps[v.name].predict(
                    part.scaled(take / n), take, correction, prompts, settings.slo_ttft_s
                )
            )
        share_left *= 1 - take / n
    if first is None:  # no variant has room: the cheapest at its own best
        first = alone[order[0].name][2]
    return mix, first, notes


class SloPolicy:
    name = "slo"
    derives_scale_down_delay = True

    def __init__(self, name: str = "slo") -> None:
        self.name = name
        self.fallback = KnativeLike("concurrency", OURS_TUNING)

    def knob(self, settings: AutoscaleSettings, key: str) -> float:
        value = getattr(settings, key)
        return float(getattr(OURS_TUNING, key) if value is None else value)

    def decide(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision:
        variants = settings.variants or (
            [Variant(name="", profile=settings.profile, hourly_price=settings.profile.hourly_price)]
            if settings.profile is not None
            else []
        )
        if not variants:
            return self._by_concurrency(settings, state, obs)
        k = lambda key: self.knob(settings, key)  # noqa: E731
        t = obs.at
        mem = state.memory.setdefault(self.name, SloMemory())
        assert isinstance(mem, SloMemory)
        if state.first_at is None:
            state.first_at = t
        if obs.demand > 0 or obs.requests_per_s > 0:
            state.last_demand_at = t
        mem.requests.update(t, obs.requests_per_s)
        mem.prompt.update(t, obs.prompt_tokens_per_s)
        mem.output.update(t, obs.output_tokens_per_s)
        mem.remember(t, obs.prompt_sample)
        prompts = mem.mix()
        cold = cold_start(variants, obs)
        horizon = cold + k("panic_window_s")
        now = Load(obs.requests_per_s, obs.prompt_tokens_per_s, obs.output_tokens_per_s)
        level = Load(mem.requests.forecast(0), mem.prompt.forecast(0), mem.output.forecast(0))
        ahead = Load(
            max(level.requests_per_s, mem.requests.forecast(horizon)),
            max(level.prompt_tokens_per_s, mem.prompt.forecast(horizon)),
            max(level.output_tokens_per_s, mem.output.forecast(horizon)),
        )
        reasons: list[str] = []

        primary = ReplicaCapacity(variants[0].profile)
        burst = self._bursts(mem, primary, settings, obs, now, cold, prompts)
        if burst.holding:
            # A burst has no trend to extrapolate: its rise says nothing of the next minute.
            # The held fleet (below) is what carries the next one.
            ahead = level
        if obs.queued > 0 and ahead.requests_per_s > 0:
            drain = obs.queued / horizon  # requests/s more, until the queue is gone
            ahead = ahead.scaled(1 + drain / ahead.requests_per_s)
            reasons.append(f"{obs.queued:g} queued: +{drain:.2f} req/s to drain them")

        self._feedback(mem, primary, settings, obs, level, t, prompts)
        c = mem.correction

        seasonal, cycle = mem.seasons.forecast(t + horizon)
        if seasonal is not None and _exceeds(seasonal, ahead):
            ahead = _upper(ahead, seasonal)
            reasons.append(
                f"{cycle} cycle: {seasonal.requests_per_s:.2f} req/s, "
                f"{seasonal.prompt_tokens_per_s:.0f} prompt tok/s expected in {horizon:g}s"
            )

        # Nothing arriving, nothing in flight and nothing to hold for: no work now (the
        # smoothed load only decays towards zero); the scale-down delay and the grace before
        # zero decide from here.
        idle = obs.requests_per_s <= 0 and obs.demand <= 0
        idle = idle and not (burst.holding or (seasonal is not None and seasonal.requests_per_s > 0))
        if ahead.requests_per_s > 0 and not idle:
            mix, pred, notes = cheapest_mix(variants, ahead, settings, c, prompts)
            desired = sum(mix.values())
            reasons.append(
                f"load {ahead.requests_per_s:.2f} req/s, {ahead.prompt_tokens_per_s:.0f} prompt + "
                f"{ahead.output_tokens_per_s:.0f} output tok/s (next {horizon:g}s) -> {desired}: "
                f"TTFT {pred.ttft_s:.2f}s / {settings.slo_ttft_s:g}s ({100 * pred.attainment:.1f}% of "
                f"{100 * pred.attainable:.1f}% attainable within), ITL {pred.itl_s * 1000:.0f}ms / "
                f"{settings.slo_itl_s * 1000:g}ms"
                + ("" if meets(pred, settings) else f" (targets out of reach: {pred.why or 'at max'})")
            )
            if c != 1.0:
                reasons.append(f"service times x{c:.2f} from observed TTFT")
            if len(variants) > 1:
                reasons.append("mix: " + ", ".join(notes))
        else:
            mix, pred, desired = (
                {},
                primary.predict(now, max(1, obs.ready), c, prompts, settings.slo_ttft_s),
                0,
            )
            reasons.append("no work arriving or in flight")

        if burst.holding and burst.need > desired:
            desired = burst.need
            reasons.append(
                f"holding {burst.need} replicas for the bursts ({burst.bursts} remembered, the "
                f"largest {burst.peak.prompt_tokens_per_s if burst.peak else 0:.0f} prompt tok/s) "
                f"for {burst.hold_s:.0f}s after the last ({burst.since_s:.0f}s ago; cold start {cold:g}s)"
            )

        # Requests in flight and queued, averaged like the concurrency policies do (the
        # short window to go up, the long one to come down), over the per-replica cap.
        state.samples.append((t, obs.demand))
        while state.samples and state.samples[0][0] <= t - k("stable_window_s"):
            state.samples.popleft()
        held = max(
            window_mean(state.samples, t - k("panic_window_s")),
            window_mean(state.samples, t - k("stable_window_s")),
        )
        floor = math.ceil(held / settings.target_concurrency - 1e-9)
        if floor > desired:
            desired = floor
            reasons.append(
                f"{held:.1f} in flight and queued / {settings.target_concurrency:g} per replica -> {floor}"
            )

        delay = scale_down_delay(settings, cold, k("stable_window_s"))
        desired = self._guards(settings, state, obs, desired, reasons, k, delay)
        bounded = min(max(desired, settings.min_replicas), settings.max_replicas)
        if bounded != desired:
            reasons.append(
                f"bounded to {bounded} by min {settings.min_replicas} / max {settings.max_replicas}"
            )
        if len(variants) > 1 and bounded != sum(mix.values()):
            mix = _rescale(mix, bounded, [v.name for v in variants])
        predicted = {**pred.as_dict(), "correction": round(c, 3), "requests_per_s": round(ahead.requests_per_s, 3),
                     "prompt_tokens_per_s": round(ahead.prompt_tokens_per_s, 1),
                     "output_tokens_per_s": round(ahead.output_tokens_per_s, 1),
                     **_burst_record(burst, cold, delay, seasonal, cycle)}  # fmt: skip
        return Decision(
            bounded,
            obs.current,
            "; ".join(reasons),
            stable_demand=ahead.requests_per_s,
            panic_demand=now.requests_per_s,
            mix=mix if len(variants) > 1 else {},
            predicted=predicted,
        )

    def seed_cycles(self, state: ScalerState, history: Seasons, at: float) -> list[str]:
        """The deployment's recorded work lends its memory the daily and weekly cycles it has
        not seen as long (`Seasons.seed_from`): what a fresh memory knows of the day ahead."""
        mem = state.memory.setdefault(self.name, SloMemory())
        assert isinstance(mem, SloMemory)
        return mem.seasons.seed_from(history, at)

    def _by_concurrency(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision:
        """Without a profile: the concurrency policy, holding UNSET_SCALE_DOWN_DELAY_S where the
        version sets no delay (no capacity model to weigh a cold start against)."""
        if settings.scale_down_delay_s is None:
            settings = settings.model_copy(update={"scale_down_delay_s": UNSET_SCALE_DOWN_DELAY_S})
        d = self.fallback.decide(settings, state, obs)
        return Decision(d.desired, d.current, f"no performance profile, by concurrency: {d.reason}",
                        d.stable_demand, d.panic_demand, d.panic)  # fmt: skip

    def _bursts(
        self,
        mem: SloMemory,
        cap: ReplicaCapacity,
        settings: AutoscaleSettings,
        obs: Observation,
        now: Load,
        cold: float,
        prompts: list[int],
    ) -> BurstView:
        """The burst memory and the cycles take this tick's work: what arrives in bursts and
        at this time of day, which a rate and its trend do not show one cold start ahead."""
        c = mem.correction

        def need(load: Load) -> tuple[int, float]:
            # Replicas at the targets, and replicas busy prefilling at their best batching
            # (what a queue drains at while a burst outruns the fleet).
            n = smallest(cap, load, settings, settings.max_replicas, c, prompts)[0]
            return n, load.requests_per_s * cap.prefill_cost(load.mean_prefill, load.requests_per_s, c)

        t = obs.at
        idle = obs.ready == 0 and obs.demand <= 0 and now.requests_per_s <= 0
        mem.burst.update(t, now, need, settings.slo_ttft_s, idle=idle)
        mem.seasons.observe(t, now)
        return mem.burst.view(t, cold, MISS_BUDGET)

    def _feedback(
        self,
        mem: SloMemory,
        cap: ReplicaCapacity,
        settings: AutoscaleSettings,
        obs: Observation,
        level: Load,
        t: float,
        prompts: list[int],
    ) -> None:
        """Observed TTFT / predicted TTFT at the ready replicas (both at the current level of
        load), smoothed over CORRECTION_S, within CORRECTION_BOUNDS. A slow TTFT corrects the
        model only where it predicted the ready replicas would do: where it already knew
        they were too few (a burst, a backlog, a cold start), that is no news about the model."""
        if obs.ttft_s is None or obs.ready <= 0 or level.requests_per_s <= 0:
            return
        expected = cap.predict(level, obs.ready, mem.correction, prompts, settings.slo_ttft_s)
        if not expected.feasible or expected.ttft_s <= 0:
            return
        # While requests are queued, the answers waited for the backlog, not for the service
        # times (and the fastest, answered first, say no more): no evidence either way.
        if obs.queued > 0 or (obs.ttft_s > expected.ttft_s and not meets(expected, settings)):
            # Skipped time is no evidence either: after a long backlog, the first interval
            # (its last queued requests' waits) must not weigh as the whole gap.
            mem.corrected_at = t
            return
        lo, hi = CORRECTION_BOUNDS
        ratio = min(hi, max(lo, mem.correction * obs.ttft_s / expected.ttft_s))
        dt = t - mem.corrected_at if mem.corrected_at is not None else 0.0
        a = 1 - math.exp(-max(0.0, dt) / CORRECTION_S)
        mem.correction = min(hi, max(lo, (1 - a) * mem.correction + a * ratio))
        mem.corrected_at = t

    def _guards(
        self,
        settings: AutoscaleSettings,
        state: ScalerState,
        obs: Observation,
        desired: int,
        reasons: list[str],
        k,
        delay_s: float,
    ) -> int:
        desired = hold_scale_down(state, obs, desired, delay_s, k("stable_window_s"), reasons)
        desired = limit_scale_down(obs, desired, k("max_scale_down_rate"), reasons)
        return guard_zero(settings, state, obs, desired, k("scale_to_zero_grace_s"), reasons)


def _rescale(mix: dict[str, int], total: int, order: list[str]) -> dict[str, int]:
    """A mix grown or shrunk to `total` replicas (guards and bounds moved the count):
    growth goes to the mix's first (cheapest) variant, shrinking takes from its last."""
    out = dict(mix) or {order[0]: 0}
    names = list(out)
    diff = total - sum(out.values())
    if diff > 0:
        out[names[0]] += diff
    for name in reversed(names):
        if diff >= 0:
            break
        take = min(out[name], -diff)
        out[name] -= take
        diff += take
    return {n: c for n, c in out.items() if c > 0}


def cold_start(variants: list[Variant], obs: Observation) -> float:
    """Seconds from asking for a replica to its serving: what the agents measured for this
    deployment's replicas when they reported it, else the slowest variant's profile."""
    if obs.cold_start_s is not None and obs.cold_start_s > 0:
        return float(obs.cold_start_s)
    return max(v.profile.cold_start_s for v in variants)


def scale_down_delay(settings: AutoscaleSettings, cold_s: float, window_s: float) -> float:
    """The deployment's own delay when it sets one; else one cold start and a stable window:
    holding a replica for a cold start costs no more GPU time than starting it again would
    (a starting replica is paid for), and a drop is trusted only once a stable window has
    seen it. Longer holds are the burst memory's, on the gaps it has seen."""
    if settings.scale_down_delay_s is not None:
        return float(settings.scale_down_delay_s)
    return cold_s + window_s


def _exceeds(a: Load, b: Load) -> bool:
    return (
        a.requests_per_s > b.requests_per_s
        or a.prompt_tokens_per_s > b.prompt_tokens_per_s
        or a.output_tokens_per_s > b.output_tokens_per_s
    )


def _upper(a: Load, b: Load) -> Load:
    return Load(
        max(a.requests_per_s, b.requests_per_s),
        max(a.prompt_tokens_per_s, b.prompt_tokens_per_s),
        max(a.output_tokens_per_s, b.output_tokens_per_s),
        a.prefix_reuse,
    )


def _burst_record(
    burst: BurstView, cold: float, delay: float, seasonal: Load | None, cycle: str
) -> dict[str, object]:
    """The burst forecast, the capacity held for it and the delays, for the decision's record
    (and the loop's gauges)."""
    finite = lambda x: round(x, 1) if x is not None and math.isfinite(x) else None  # noqa: E731
    return {
        "cold_start_s": round(cold, 1),
        "scale_down_delay_s": round(delay, 1),
        "burst_need": burst.need,
        "burst_holding": burst.holding,
        "burst_held": burst.need if burst.holding else 0,
        "burst_hold_s": finite(burst.hold_s),
        "burst_since_s": finite(burst.since_s),
        "burst_gap_s": finite(burst.gap_s),
        "bursts": burst.bursts,
        "burst_prompt_tokens_per_s": round(burst.peak.prompt_tokens_per_s, 1) if burst.peak else 0.0,
        "seasonal_cycle": cycle,
        "seasonal_prompt_tokens_per_s": round(seasonal.prompt_tokens_per_s, 1) if seasonal else None,
    }


def least_latency(
    settings: AutoscaleSettings, state: ScalerState | None, obs: Observation
) -> tuple[float | None, float]:
    """(TTFT, ITL) the deployment reaches with the least load, by the capacity model this
    policy scales with: a mean prompt prefilled on an empty queue, one sequence decoding, at
    the policy's current service-time correction; the fastest variant. No replica count
    does better, so a target below these is one no scaling buys. TTFT None: no prompt seen.
    Raises ValueError without a profile."""
    variants = settings.variants or (
        [Variant(name="", profile=settings.profile, hourly_price=settings.profile.hourly_price)]
        if settings.profile is not None
        else []
    )
    if not variants:
        raise ValueError("no performance profile")
    memory = [m for m in (state.memory.values() if state is not None else ()) if isinstance(m, SloMemory)]
    c = memory[0].correction if memory else 1.0
    itl = min(v.profile.decode_time(1) for v in variants) * c
    if obs.requests_per_s <= 0 or obs.prompt_tokens_per_s <= 0:
        return None, itl
    prompt = obs.prompt_tokens_per_s / obs.requests_per_s
    return min(v.profile.prefill_time(prompt) for v in variants) * c, itl
