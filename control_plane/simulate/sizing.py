"""How many replicas a static deployment of a trace is provisioned for: the replicas the
capacity model (`control_plane.autoscale.capacity`, the one the SLO policy scales by) needs
to meet the TTFT and ITL targets at the trace's busiest window, as an operator would size a
fixed fleet for its peak. Not `max_replicas`: that is an autoscaling bound, and a fleet
sized to it is nearly idle, which hides every difference in how requests are placed.

The model assumes no prefix caching (every prompt token is prefilled), so the count is what
least-load routing needs; what prefix routing saves shows as latency at that count."""

from __future__ import annotations

from dataclasses import dataclass

from agent.sim.profile import PerfProfile
from control_plane.autoscale.capacity import Load, ReplicaCapacity
from control_plane.autoscale.policy import AutoscaleSettings
from control_plane.autoscale.slo import meets, smallest
from control_plane.simulate.trace import TraceRequest

PEAK_WINDOW_S = 60.0  # the autoscalers' stable window: load is judged per minute
MIX_SAMPLE = 256  # prompt lengths of a window the prediction sees (evenly spaced)


@dataclass(frozen=True)
class StaticSize:
    replicas: int
    window_start_s: float  # the busiest window (the one needing the most replicas)
    why: str


def peak_size(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    window_s: float = PEAK_WINDOW_S,
) -> StaticSize:
    """The most replicas any window of `window_s` (stepped by half of it) needs, within
    `min_replicas` (at least one) .. `max_replicas`."""
    floor, cap_n = max(1, settings.min_replicas), max(1, settings.max_replicas)
    if not trace:
        return StaticSize(floor, 0.0, "empty trace")
    cap = ReplicaCapacity(profile)
    best = StaticSize(floor, 0.0, f"min_replicas {floor}")
    end = trace[-1].at
    lo = hi = 0
    start = 0.0
    while True:
        while lo < len(trace) and trace[lo].at < start:
            lo += 1
        hi = max(hi, lo)
        while hi < len(trace) and trace[hi].at < start + window_s:
            hi += 1
        window = trace[lo:hi]
        if window:
            span = min(window_s, max(end, 1.0))  # a trace shorter than the window: its length
            load = Load(
                len(window) / span,
                sum(r.prompt_tokens for r in window) / span,
                sum(r.output_tokens for r in window) / span,
            )
            step = max(1, len(window) // MIX_SAMPLE)
            prompts = [r.prompt_tokens for r in window[::step]]
            n, pred = smallest(cap, load, settings, cap_n, 1.0, prompts)
            if n > best.replicas:
                met = "meets" if meets(pred, settings) else "misses (capped at max_replicas)"
                best = StaticSize(
                    n,
                    start,
                    f"capacity model at the busiest {window_s:g} s (from {start:g} s: "
                    f"{load.requests_per_s:.2f} req/s, {load.prompt_tokens_per_s:,.0f} prompt tok/s) "
                    f"{met} TTFT {settings.slo_ttft_s:g} s / ITL {settings.slo_itl_s:g} s",
                )
        if start + window_s >= end:
            break
        start += window_s / 2
    return best
