"""`fleetctl simulate`: replay a trace in virtual time through the real routing and
autoscaling policies and simulated replicas, and compare policies."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.autoscale.policy import AutoscaleSettings
from control_plane.simulate.best_fixed import search
from control_plane.simulate.bounds import has_blocks, ideal_reuse, shared_cache_bound
from control_plane.simulate.des import RunResult, Simulation
from control_plane.simulate.report import BestFixedFleet, PolicyReport, SimulationReport, plot, summarize
from control_plane.simulate.residency import describe_shares, merge, split_trace
from control_plane.simulate.sizing import peak_size
from control_plane.simulate.trace import TraceError, TraceRequest, load_trace
from fleet_base.cluster_config import GatewayConfig
from fleet_base.profile import PerfProfile

GIB = 1 << 30
DEFAULT_POLICIES = ("static", "kpa", "planner", "ours")
# The live gateway's replica choice unless configured otherwise: simulated as it runs.
DEFAULT_ROUTINGS: tuple[str, ...] = (GatewayConfig.model_fields["routing"].default,)


def default_settings(profile: PerfProfile) -> AutoscaleSettings:
    """Half the profile's batch limit per replica, up to 64 replicas."""
    return AutoscaleSettings(
        min_replicas=1, max_replicas=64, target_concurrency=max(1.0, profile.max_num_seqs / 2)
    )


def compare(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    *,
    trace_name: str = "",
    slo_ttft_s: float | None = None,
    slo_itl_s: float | None = None,
    rate_scale: float = 1.0,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    routings: tuple[str, ...] = DEFAULT_ROUTINGS,
    static_replicas: int | None = None,
    tick_s: float = 2.0,
    warmup_s: float = 300.0,
    plot_path: Path | None = None,
    on_run: Callable[[str], None] | None = None,
    residency_shares: dict[str, float] | None = None,
    best_fixed: bool = True,
) -> SimulationReport:
    """Runs every policy on the same trace, against the targets (`slo_ttft_s`, `slo_itl_s`;
    None: the settings' own, which the SLO-driven policies aim at). `static` gets the peak replica count the
    autoscaled runs reached (provisioning for the peak); run alone, the count the capacity
    model needs at the trace's busiest minute (`sizing.peak_size`; at the prefix reuse the
    trace's block ids give when prefix routing is among `routings`). Autoscaled runs start at
    `min_replicas` (at least one) and the first `warmup_s` of trace only warms them up:
    requests arriving then and GPU time spent then are not counted, for any policy.
    `on_run(policy)` is called as each policy's run starts (progress).
    `static_replicas` fixes the static run's count instead. Each routing in `routings`
    (agent.gateway.plan: least-load, prefix) runs every policy on the same replicas.
    `residency_shares` (jurisdiction -> share of requests) runs every policy a second time
    with each jurisdiction's requests on a fleet of its own (`simulate.residency`), the
    report listing both: the cost of residency against no policy.
    `best_fixed` searches static runs (on the first routing) for the best fixed fleet
    (`simulate.best_fixed`), from the static runs' count, and reads every row against it:
    its GPU-hours over the best fixed fleet's, and whether it reaches that target.
    A trace with block ids gets its two references (`simulate.bounds`), on the static runs'
    count: the ideal reuse and the shared-cache bound; every row is read against them."""
    started = time.perf_counter()
    targets = {"slo_ttft_s": slo_ttft_s, "slo_itl_s": slo_itl_s}
    settings = settings.model_copy(
        update={"profile": settings.profile or profile, **{k: v for k, v in targets.items() if v is not None}}
    )
    slo_ttft_s, slo_itl_s = settings.slo_ttft_s, settings.slo_itl_s
    reports: list[PolicyReport] = []
    runs, peak, sizing, reuse = _runs(
        trace, profile, settings, policies, routings, static_replicas, tick_s, warmup_s, on_run
    )
    bound: dict[tuple[str, str], RunResult] = {}
    bound_static: dict[str, int] = {}
    if residency_shares:
        parts = {j: part for j, part in split_trace(trace, residency_shares).items() if part}
        per_part = {
            j: _runs(part, profile, settings, policies, routings, None, tick_s, warmup_s, on_run)
            for j, part in parts.items()
        }
        bound = {key: merge([got[0][key] for got in per_part.values()]) for key in runs}
        bound_static = {j: got[1] for j, got in per_part.items()} if "static" in policies else {}
    for name in policies:
        for routing in routings:
            reports.append(summarize(runs[(name, routing)], profile, slo_ttft_s, slo_itl_s=slo_itl_s))
            if (name, routing) in bound:
                split = summarize(bound[(name, routing)], profile, slo_ttft_s, slo_itl_s=slo_itl_s)
                reports.append(
                    split.model_copy(update={"residency": describe_shares(residency_shares or {})})
                )
    ideal, bound_row = None, None
    if has_blocks(trace):
        if on_run:
            on_run("shared-cache bound")
        ideal = round(ideal_reuse(trace, warmup_s), 4)
        got = shared_cache_bound(trace, profile, settings, peak, tick_s=tick_s, warmup_s=warmup_s)
        bound_row = summarize(got, profile, slo_ttft_s, slo_itl_s=slo_itl_s)
        reports = [against(r, ideal, bound_row) for r in reports]
        bound_row = against(bound_row, ideal, bound_row)
    best = None
    if best_fixed and trace:
        best = _best_fixed(trace, profile, settings, routings[0], peak, runs, tick_s, warmup_s, on_run)
        reports = [
            r.model_copy(
                update={
                    "gpu_hours_vs_best_fixed": round(r.gpu_hours / best.gpu_hours, 3)
                    if best.gpu_hours > 0
                    else None,
                    "reaches_target": r.within_ttft_target >= best.target,
                }
            )
            for r in reports
        ]
    duration = trace[-1].at if trace else 0.0
    report = SimulationReport(
        trace=trace_name,
        profile=profile.name,
        requests=len(trace),
        duration_s=round(duration, 1),
        slo_ttft_s=slo_ttft_s,
        slo_itl_s=slo_itl_s,
        rate_scale=rate_scale,
        warmup_s=warmup_s,
        settings=settings.model_dump(),
        policies=reports,
        static_replicas=peak if "static" in policies else None,
        static_sizing=sizing if "static" in policies else "",
        static_prefix_reuse=reuse,
        residency_shares=residency_shares or None,
        residency_static_replicas=bound_static,
        best_fixed=best,
        host_kv_blocks=profile.host_kv_tokens
        // max(1, next((r.block_tokens for r in trace if r.hash_ids), 0)),
        device_kv_gib=round(profile.kv_capacity_tokens * profile.kv_bytes_per_token / GIB, 1),
        host_kv_gib=round(profile.host_kv_bytes / GIB, 1),
        long_prefill_token_threshold=profile.long_prefill_token_threshold,
        ideal_reuse=ideal,
        shared_cache_bound=bound_row,
    )
    if plot_path is not None:
        plot(report, {f"{p}/{r}" if len(routings) > 1 else p: run for (p, r), run in runs.items()}, plot_path)
    report.wall_s = round(time.perf_counter() - started, 2)
    return report


def against(row: PolicyReport, ideal: float, bound: PolicyReport) -> PolicyReport:
    """A row read against the trace's ideal reuse and the shared-cache bound."""

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b > 0 and math.isfinite(a) and math.isfinite(b) else None

    return row.model_copy(
        update={
            "hit_rate_vs_ideal": ratio(row.cache_hit_rate, ideal),
            "ttft_p90_vs_bound": ratio(row.ttft_p90_s, bound.ttft_p90_s),
            "throughput_vs_bound": ratio(row.throughput_tok_s, bound.throughput_tok_s),
        }
    )


def _best_fixed(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    routing: str,
    start: int,
    runs: dict[tuple[str, str], RunResult],
    tick_s: float,
    warmup_s: float,
    on_run: Callable[[str], None] | None,
) -> BestFixedFleet:
    """The search from the static runs' count, reusing that run when there is one."""
    done = runs.get(("static", routing))

    def run(n: int) -> PolicyReport:
        if done is not None and n == start:
            got = done
        else:
            if on_run:
                on_run(f"best fixed fleet: {n} replicas")
            got = _static(trace, profile, settings, n, tick_s, warmup_s, routing)
        return summarize(got, profile, settings.slo_ttft_s, slo_itl_s=settings.slo_itl_s)

    return search(run, start)


def _static(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    replicas: int,
    tick_s: float,
    warmup_s: float,
    routing: str,
) -> RunResult:
    """A fixed fleet of `replicas`, all ready from the start."""
    s = settings.model_copy(
        update={"max_replicas": replicas, "min_replicas": min(settings.min_replicas, replicas)}
    )
    return Simulation(
        trace,
        profile,
        s,
        "static",
        tick_s=tick_s,
        initial_replicas=replicas,
        warmup_s=warmup_s,
        routing=routing,
    ).run()


def _runs(
    trace: list[TraceRequest],
    profile: PerfProfile,
    settings: AutoscaleSettings,
    policies: tuple[str, ...],
    routings: tuple[str, ...],
    static_replicas: int | None,
    tick_s: float,
    warmup_s: float,
    on_run: Callable[[str], None] | None,
) -> tuple[dict[tuple[str, str], RunResult], int, str, float | None]:
    """Every (policy, routing) run of one trace on one fleet, and the static runs' size
    (replicas, why, the prefix reuse that sizing assumed)."""
    runs: dict[tuple[str, str], RunResult] = {}
    autoscaled = [p for p in policies if p != "static"]
    peak, sizing = settings.max_replicas, f"max_replicas {settings.max_replicas}"
    reuse: float | None = None
    order = [*autoscaled, *(["static"] if "static" in policies else [])]
    initial = max(1, settings.min_replicas)
    if autoscaled:
        if on_run:
            on_run(autoscaled[-1])
        probe = Simulation(
            trace,
            profile,
            settings,
            autoscaled[-1],
            tick_s=tick_s,
            initial_replicas=initial,
            warmup_s=warmup_s,
            routing=routings[0],
        ).run()
        peak = max((s.desired for s in probe.samples), default=1)
        sizing = f"the peak of {probe.policy}"
        runs[(probe.policy, routings[0])] = probe
    elif "static" in policies and static_replicas is None:
        size = peak_size(trace, profile, settings, prefix_caching="prefix" in routings)
        peak, sizing, reuse = size.replicas, size.why, size.prefix_reuse
    if static_replicas is not None:
        peak, sizing, reuse = static_replicas, "--replicas", None
    for routing in routings:  # every routing at the same replicas: static gets the same peak
        for name in order:
            if (name, routing) in runs:
                continue
            if on_run:
                on_run(name if len(routings) == 1 else f"{name}/{routing}")
            if name == "static":
                runs[(name, routing)] = _static(trace, profile, settings, peak, tick_s, warmup_s, routing)
                continue
            runs[(name, routing)] = Simulation(
                trace,
                profile,
                settings,
                name,
                tick_s=tick_s,
                initial_replicas=initial,
                warmup_s=warmup_s,
                routing=routing,
            ).run()
    return runs, peak, sizing, reuse


__all__ = [
    "DEFAULT_POLICIES",
    "DEFAULT_ROUTINGS",
    "TraceError",
    "compare",
    "default_settings",
    "load_trace",
    "math",
]
