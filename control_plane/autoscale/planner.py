"""`planner`: a comparison policy following NVIDIA Dynamo's SLA planner as its public
design documents describe it (docs/architecture/sla_planner.md), adapted to aggregated
replicas (each does its own prefill and decode). Written from that description.

Every adjustment interval (here the stable window, 60 s by default):
1. metrics of the interval: request count, mean input (ISL) and output (OSL) lengths,
   mean TTFT and ITL;
2. correction factors: prefill = observed TTFT / expected TTFT (the profile's prefill time
   at the ISL, batch of one), decode = observed ITL / expected ITL (the profile's step time
   at the batch the interval ran);
3. load prediction: the constant predictor (the next interval is like this one);
4. prefill replicas = requests x ISL / interval x min(1, prefill correction) / (prefill
   tokens/s of one replica at the ISL); decode replicas = requests x OSL / interval /
   (the best decode tokens/s of one replica whose step time meets ITL / decode correction,
   with the KV of ISL + OSL/2 per sequence); Dynamo scales prefill and decode workers
   apart, an aggregated replica does both, so the count is the sum of the two shares,
   rounded up;
5. scale straight to it (no scale-down delay), within min..max; between adjustments the
   count holds. Scale to zero and back as the other policies do (Dynamo has none)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from control_plane.autoscale.policy import AutoscaleSettings, Decision, Observation, ScalerState

DEFAULT_INTERVAL_S = 60.0


@dataclass
class Interval:
    started: float
    last: float
    requests: float = 0.0
    prompt: float = 0.0
    output: float = 0.0
    ttft_weighted: float = 0.0
    itl_weighted: float = 0.0
    ttft_weight: float = 0.0
    itl_weight: float = 0.0
    batch_weighted: float = 0.0
    time: float = 0.0


class SlaPlanner:
    name = "planner"
    derives_scale_down_delay = False

    def decide(self, settings: AutoscaleSettings, state: ScalerState, obs: Observation) -> Decision:
        prof = settings.profile or (settings.variants[0].profile if settings.variants else None)
        interval_s = settings.stable_window_s or DEFAULT_INTERVAL_S
        t = obs.at
        iv = state.memory.get(self.name)
        if not isinstance(iv, Interval):
            iv = state.memory[self.name] = Interval(t, t)
        dt = max(0.0, t - iv.last)
        iv.last = t
        iv.time += dt
        iv.requests += obs.requests_per_s * dt
        iv.prompt += obs.prompt_tokens_per_s * dt
        iv.output += obs.output_tokens_per_s * dt
        iv.batch_weighted += (obs.in_flight / max(1, obs.ready)) * dt
        if obs.ttft_s is not None:
            iv.ttft_weighted += obs.ttft_s * dt
            iv.ttft_weight += dt
        if obs.itl_s is not None:
            iv.itl_weighted += obs.itl_s * dt
            iv.itl_weight += dt
        if obs.demand > 0 or obs.requests_per_s > 0:
            state.last_demand_at = t
        current = obs.current
        if obs.demand > 0 and obs.current == 0 and obs.ready == 0:
            want = max(1, settings.min_replicas)
            return Decision(
                min(want, settings.max_replicas), current, "scale from zero: demand with no replica"
            )
        if prof is None or t - iv.started < interval_s:
            return Decision(current, current, f"planner: holding until the {interval_s:g}s adjustment")
        state.memory[self.name] = Interval(t, t)
        if iv.requests <= 0 or iv.time <= 0:
            zero = settings.scale_to_zero and settings.min_replicas == 0
            want = 0 if zero else max(1, settings.min_replicas)
            return Decision(
                want, current, "scale to zero: no requests in the interval" if zero else "no requests"
            )
        isl = iv.prompt / iv.requests
        osl = max(1.0, iv.output / iv.requests)
        batch = max(1.0, iv.batch_weighted / iv.time)
        expected_ttft = prof.prefill_time(isl)
        expected_itl = prof.decode_time(batch)
        p_corr = (
            (iv.ttft_weighted / iv.ttft_weight) / expected_ttft if iv.ttft_weight and expected_ttft else 1.0
        )
        d_corr = (iv.itl_weighted / iv.itl_weight) / expected_itl if iv.itl_weight and expected_itl else 1.0
        rate = iv.requests / iv.time
        prefill_load = rate * isl * min(1.0, p_corr)
        prefill_thpt = isl / prof.prefill_time(isl) if prof.prefill_time(isl) > 0 else math.inf
        corrected_itl = settings.slo_itl_s / max(d_corr, 1e-6)
        context = isl + osl / 2
        best = 0.0
        for b in range(1, int(min(prof.max_num_seqs, settings.target_concurrency)) + 1):
            if prof.decode_time(b) <= corrected_itl and b * context <= prof.kv_capacity_tokens:
                best = max(best, b / prof.decode_time(b))
        decode_thpt = best or 1.0 / prof.decode_time(1)
        share = prefill_load / prefill_thpt + rate * osl / decode_thpt
        want = max(1, math.ceil(share - 1e-9))
        bounded = min(max(want, settings.min_replicas), settings.max_replicas)
        reason = (
            f"planner: {rate:.2f} req/s, ISL {isl:.0f}, OSL {osl:.0f}; corrections prefill {p_corr:.2f} "
            f"decode {d_corr:.2f}; prefill {prefill_load / prefill_thpt:.2f} + decode "
            f"{rate * osl / decode_thpt:.2f} replicas -> {bounded}"
        )
        return Decision(bounded, current, reason, stable_demand=rate)
