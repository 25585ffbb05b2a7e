"""What a simulated run cost and how it served: GPU-hours, cost, TTFT / end-to-end
percentiles, the share of requests within the TTFT target, queue time, cold starts, and
replicas over time; plus a PNG of load against replicas per policy."""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel

from control_plane.simulate.des import RunResult
from fleet_base.profile import PerfProfile


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of `values` (q in 0..100); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


class PolicyReport(BaseModel):
    policy: str
    routing: str = "prefix"  # the gateway's replica choice (agent.gateway.plan)
    requests: int
    completed: int
    gpu_hours: float
    replica_hours: float
    cost: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    within_ttft_target: float  # share of all requests (unfinished ones count as misses)
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    within_itl_target: float = 0.0  # share of requests with 2+ output tokens (unfinished: misses)
    queue_mean_s: float
    queue_p99_s: float
    cold_starts: int
    replicas_max: int
    replicas_mean: float
    timeline: list[tuple[float, int, float]]  # (t, replicas allocated, demand) per sample
    # prompt tokens found in the replicas' prefix caches / prompt tokens (admitted requests)
    cache_hit_rate: float = 0.0
    host_hit_rate: float = 0.0  # of which found in their host tiers (loaded back)
    throughput_tok_s: float = 0.0  # output tokens of finished requests per second, over the run
    # read against the trace's references (simulate.bounds): hit rate over the ideal reuse,
    # TTFT p90 and throughput over the shared-cache bound's (None: no block ids)
    hit_rate_vs_ideal: float | None = None
    ttft_p90_vs_bound: float | None = None
    throughput_vs_bound: float | None = None
    # "": one fleet serves every request; else each jurisdiction's share on its own fleet
    residency: str = ""
    # GPU-hours over the best fixed fleet's, and whether within_ttft_target reaches its target
    gpu_hours_vs_best_fixed: float | None = None
    reaches_target: bool | None = None


class BestFixedFleet(BaseModel):
    """The smallest static count reaching the target (`simulate.best_fixed`)."""

    replicas: int
    gpu_hours: float
    within_ttft_target: float  # the attainment of that count's static run
    target: float  # the attainment a fleet must reach: 0.99, or ceiling - 0.005
    target_basis: str  # "99%" or "ceiling - 0.5 points"
    ceiling: float  # the attainment of the largest count run
    ceiling_replicas: int
    ceiling_saturated: bool  # doubling it gained under 0.1 points (or it reached 99%)
    non_monotone: bool  # some count did worse than a smaller one
    runs: list[tuple[int, float]]  # (count, attainment) of every static run, by count
    summary: PolicyReport  # the chosen count's run (without its timeline)
    why: str


class SimulationReport(BaseModel):
    trace: str
    profile: str
    requests: int
    duration_s: float
    slo_ttft_s: float
    slo_itl_s: float = math.nan
    rate_scale: float
    warmup_s: float = 0.0
    settings: dict[str, object]
    wall_s: float = 0.0
    static_replicas: int | None = None  # replicas of the static runs (every routing alike)
    static_sizing: str = ""  # why that many (simulate.sizing)
    static_prefix_reuse: float | None = None  # the share of prompt tokens that sizing assumed cached
    policies: list[PolicyReport]
    # --residency-shares: jurisdiction -> share of the requests; each policy then runs twice
    residency_shares: dict[str, float] | None = None
    residency_static_replicas: dict[str, int] = {}  # the static run's replicas per jurisdiction
    best_fixed: BestFixedFleet | None = None  # the cheapest static answer (None: not searched)
    host_kv_blocks: int = 0  # each replica's host KV tier, in the trace's blocks (0: none)
    device_kv_gib: float = 0.0  # each replica's device KV (0: the profile does not say its bytes)
    host_kv_gib: float = 0.0  # each replica's host KV tier (--kv-offloading-size)
    long_prefill_token_threshold: int = 0  # the replicas' long-prefill cap (0: first come, first served)
    # references for traces with block ids (simulate.bounds; None: the trace has none)
    ideal_reuse: float | None = None  # hit rate of one unlimited cache over the trace
    shared_cache_bound: PolicyReport | None = None  # least-load over one cache of the fleet's capacity


def summarize(
    run: RunResult,
    profile: PerfProfile,
    slo_ttft_s: float,
    timeline_every: int = 5,
    slo_itl_s: float = math.inf,
) -> PolicyReport:
    done = [r for r in run.measured if r.finished_at is not None and r.first_token_at is not None]
    ttft = [r.first_token_at - r.arrival for r in done]  # type: ignore[operator]
    e2e = [r.finished_at - r.arrival for r in done]  # type: ignore[operator]
    queue = [(r.admitted_at - r.arrival) for r in done if r.admitted_at is not None]
    within = sum(1 for x in ttft if x <= slo_ttft_s)
    # Mean inter-token latency of each request that streams (2+ output tokens).
    streams = [r for r in run.measured if r.output_tokens > 1]
    itl = [(r.finished_at - r.first_token_at) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]  # type: ignore[operator]
    within_itl = sum(1 for x in itl if x <= slo_itl_s)
    replica_h = run.replica_seconds / 3600
    n = len(run.measured)
    replicas = [s.replicas for s in run.samples]
    admitted = [r for r in run.measured if r.admitted_at is not None]
    prompt = sum(r.prompt_tokens for r in admitted)
    span = max((r.finished_at for r in done), default=0.0) - min((r.arrival for r in done), default=0.0)  # type: ignore[type-var]
    return PolicyReport(
        policy=run.policy,
        routing=run.routing,
        cache_hit_rate=round(sum(r.cached_tokens for r in admitted) / prompt, 4) if prompt else 0.0,
        host_hit_rate=round(sum(r.host_tokens for r in admitted) / prompt, 4) if prompt else 0.0,
        throughput_tok_s=round(sum(r.output_tokens for r in done) / span, 1) if span > 0 else 0.0,
        requests=n,
        completed=len(done),
        gpu_hours=round(replica_h * profile.gpus_per_replica, 3),
        replica_hours=round(replica_h, 3),
        cost=round(replica_h * profile.hourly_price, 2),
        ttft_p50_s=round(percentile(ttft, 50), 4),
        ttft_p90_s=round(percentile(ttft, 90), 4),
        ttft_p99_s=round(percentile(ttft, 99), 4),
        e2e_p50_s=round(percentile(e2e, 50), 3),
        e2e_p99_s=round(percentile(e2e, 99), 3),
        within_ttft_target=round(within / n, 5) if n else 0.0,
        itl_p50_s=round(percentile(itl, 50), 4),
        itl_p99_s=round(percentile(itl, 99), 4),
        within_itl_target=round(within_itl / len(streams), 5) if streams else 1.0,
        queue_mean_s=round(sum(queue) / len(queue), 4) if queue else 0.0,
        queue_p99_s=round(percentile(queue, 99), 4),
        cold_starts=run.cold_starts,
        replicas_max=max(replicas, default=0),
        replicas_mean=round(sum(replicas) / len(replicas), 2) if replicas else 0.0,
        timeline=[(s.at, s.replicas, round(s.demand, 2)) for s in run.samples[::timeline_every]],
    )


def plot(report: SimulationReport, runs: dict[str, RunResult], out: Path) -> None:
    """Load (arrivals per minute) and replicas per policy over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_rep) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[1, 1.4])
    first = next(iter(runs.values()))
    minutes: dict[int, int] = {}
    prompt: dict[int, int] = {}
    for r in first.requests:
        m = int(r.arrival // 60)
        minutes[m] = minutes.get(m, 0) + 1
        prompt[m] = prompt.get(m, 0) + r.prompt_tokens
    xs = sorted(minutes)
    ax_load.bar([x for x in xs], [minutes[x] for x in xs], width=0.9, color="#999")
    ax_load.set_ylabel("requests / min")
    ax_work = ax_load.twinx()  # the work: what the SLO policy scales on
    ax_work.plot([x for x in xs], [prompt[x] / 60 for x in xs], color="#c44", lw=1.2)
    ax_work.set_ylabel("prompt tokens / s", color="#c44")
    ax_load.set_title(
        f"{report.trace} x{report.rate_scale:g} on {report.profile} "
        f"(targets: TTFT {report.slo_ttft_s:g} s, ITL {1000 * report.slo_itl_s:g} ms)"
    )
    for pr in report.policies:
        run = runs.get(f"{pr.policy}/{pr.routing}") or runs[pr.policy]
        label = (
            f"{pr.policy}: {pr.gpu_hours:.1f} GPU-h, {100 * pr.within_ttft_target:.2f}% within TTFT, "
            f"{100 * pr.within_itl_target:.2f}% within ITL target, TTFT p99 {pr.ttft_p99_s:.2f}s"
        )
        ax_rep.step(
            [s.at / 60 for s in run.samples], [s.replicas for s in run.samples], where="post", label=label
        )
    from matplotlib.ticker import MaxNLocator

    ax_rep.yaxis.set_major_locator(MaxNLocator(integer=True))
    if report.warmup_s > 0:
        ax_rep.axvspan(
            0, report.warmup_s / 60, color="#eee", label=f"warm-up ({report.warmup_s:g}s, not counted)"
        )
    ax_rep.set_ylabel("replicas")
    ax_rep.set_xlabel("minutes")
    ax_rep.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
