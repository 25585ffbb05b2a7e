"""`fleetctl simulate`: replay a request trace in virtual time through the real routing
and autoscaling policies and simulated replicas, and compare policies (GPU-hours, cost,
latency, share within the TTFT target, cold starts), for capacity planning."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, emit_json, fail

COLUMNS = [
    "policy",
    "routing",
    "gpu_hours",
    "cost",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "within_target",
    "itl_p50_s",
    "itl_p99_s",
    "within_itl",
    "queue_mean_s",
    "queue_p99_s",
    "cold_starts",
    "replicas_max",
    "replicas_mean",
    "cache_hit_rate",
    "host_hit_rate",
    "hit_vs_ideal",
    "p90_vs_bound",
    "throughput_tok_s",
    "vs_best_fixed",
    "reaches_target",
]


class SimulateConfig(BaseModel):
    """`--deployment-config FILE` (YAML or JSON): the deployment's autoscaling settings
    (fields of AutoscaleSettings, as in a version's `autoscaling`) and simulation knobs."""

    model_config = ConfigDict(extra="forbid")

    autoscaling: dict[str, object] = Field(default_factory=dict)
    policies: list[str] | None = None
    tick_s: float = Field(2.0, gt=0, le=60)
    warmup_s: float = Field(300.0, ge=0)
    cold_start_s: float | None = Field(None, ge=0)


def _config(path: Path | None) -> SimulateConfig:
    if path is None:
        return SimulateConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        fail(f"--deployment-config {path}: {err}")
    if isinstance(data, dict) and "autoscaling" not in data and "policies" not in data:
        data = {"autoscaling": data}  # a bare settings mapping
    try:
        return SimulateConfig.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        fail(f"--deployment-config {path}: {'.'.join(map(str, first['loc']))}: {first['msg']}")


def simulate(
    trace: Path = typer.Option(
        ...,
        "--trace",
        help="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens: conversation or code), Mooncake JSONL, "
        "or a pipeline trace (JSONL, one request a line with per-step costs: {at, steps: [{step, "
        "prompt_tokens, output_tokens}, ...]}; bench/pipeline_trace.py writes one)",
    ),
    profile: str = typer.Option(
        "llama2-70b-h100-tp4", help="performance profile name (fleet_base/profiles) or JSON path"
    ),
    deployment_config: Path = typer.Option(
        None, "--deployment-config", help="YAML/JSON: autoscaling settings"
    ),
    rate_scale: float = typer.Option(
        1.0, "--rate-scale", help="replay X times as fast (X times the request rate)"
    ),
    slo_ttft: float = typer.Option(
        None, "--slo-ttft", help="TTFT target in seconds (default: the settings' slo_ttft_s, 2)"
    ),
    slo_itl: float = typer.Option(
        None, "--slo-itl", help="inter-token latency target in seconds (default: slo_itl_s, 0.1)"
    ),
    policies: str = typer.Option(None, help="comma-separated policies (default: static,kpa,planner,ours)"),
    routing: str = typer.Option(
        None,
        "--routing",
        help="comma-separated replica choices to compare: least-load, prefix (default: the gateway's, prefix)",
    ),
    limit: float = typer.Option(None, help="only the first SECONDS of (scaled) trace"),
    replicas: int = typer.Option(
        None,
        "--replicas",
        min=1,
        help="replicas of the static run (default: the autoscaled peak, else what the capacity model needs at the busiest minute)",
    ),
    plot: Path = typer.Option(None, "--plot", help="write a PNG of load and replicas over time"),
    residency_shares: str = typer.Option(
        None,
        "--residency-shares",
        help="JURISDICTION=SHARE,... of requests bound to each jurisdiction: every policy also runs "
        "with each jurisdiction's requests on its own fleet, against one shared fleet (no policy)",
    ),
    best_fixed: bool = typer.Option(
        True,
        "--best-fixed/--no-best-fixed",
        help="search static runs for the best fixed fleet (the smallest count with >= 99% within TTFT, "
        "or the ceiling a very large fleet reaches minus 0.5 points) and read every policy against it",
    ),
    slo_e2e: str = typer.Option(
        None,
        "--slo-e2e",
        help="pipeline trace: the end-to-end latency budget (e.g. 800ms, 20s); required for one",
    ),
    step_profile: list[str] = typer.Option(
        None,
        "--step-profile",
        help="pipeline trace: STEP=PROFILE, a step's own performance profile (default: --profile); repeatable",
    ),
    hop_ms: float = typer.Option(
        10.0, "--hop-ms", min=0, help="pipeline trace: one step-to-step hop inside a cluster, in ms"
    ),
    kv_offloading_size: float = typer.Option(
        None,
        "--kv-offloading-size",
        min=0,
        help="GiB of host memory per replica for its KV tier below the device's (0: none; "
        "default: the profile's host_kv_bytes)",
    ),
    long_prefill_token_threshold: int = typer.Option(
        None,
        "--long-prefill-token-threshold",
        min=0,
        help="the engine's long-prefill cap: a prompt needing more new tokens is prefilled one at "
        "a time and shorter ones go past it (0: off; default: the profile's)",
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Replay a trace through the routing and autoscaling policies on simulated replicas.
    A pipeline trace runs each step as its own deployment, the pipeline-aware policy against
    each step scaled alone and the fixed fleet at their peaks, in one table."""
    from control_plane.autoscale.policy import POLICIES, AutoscaleSettings
    from control_plane.simulate import (
        DEFAULT_POLICIES,
        DEFAULT_ROUTINGS,
        TraceError,
        compare,
        default_settings,
        load_trace,
    )

    if slo_ttft is not None and slo_ttft <= 0:
        fail("--slo-ttft must be > 0")
    if slo_itl is not None and slo_itl <= 0:
        fail("--slo-itl must be > 0")
    cfg = _config(deployment_config)
    prof = _profile(profile, cfg, kv_offloading_size, long_prefill_token_threshold)
    try:
        settings = AutoscaleSettings.model_validate(
            {**default_settings(prof).model_dump(), **cfg.autoscaling}
        )
    except ValidationError as err:
        first = err.errors()[0]
        fail(f"autoscaling: {'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']}")
    names = tuple(p.strip() for p in policies.split(",") if p.strip()) if policies else None
    names = names or tuple(cfg.policies or DEFAULT_POLICIES)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        fail(f"unknown policy {unknown[0]!r}; known: {', '.join(sorted(POLICIES))}")
    from fleet_base.cluster_config import ROUTINGS

    routing = ",".join(DEFAULT_ROUTINGS) if routing is None else routing
    routings = tuple(dict.fromkeys(r.strip() for r in routing.split(",") if r.strip()))
    bad = [r for r in routings if r not in ROUTINGS]
    if bad or not routings:
        fail(f"unknown routing {bad[0] if bad else routing!r}; known: {', '.join(ROUTINGS)}")
    from control_plane.simulate.trace import is_pipeline_trace

    if is_pipeline_trace(trace):
        _pipeline(trace, prof, cfg, settings, names[0], slo_e2e, step_profile or [], hop_ms, rate_scale,
                  limit, output)  # fmt: skip
        return
    shares = _shares(residency_shares)
    try:
        requests = load_trace(trace, rate_scale=rate_scale, limit_s=limit)
    except TraceError as err:
        fail(str(err))
    if not requests:
        fail(f"{trace}: no requests in the selected range")
    from rich.console import Console

    status = Console(stderr=True).status(f"simulating {len(requests)} requests")
    done: list[str] = []

    def on_run(policy: str) -> None:
        done.append(policy)
        total = len(names) * len(routings)
        if policy.startswith("best fixed"):
            status.update(f"simulating {len(requests)} requests: {policy}")
            return
        status.update(f"simulating {len(requests)} requests: {policy} ({len(done)} of {total})")

    with status:
        report = compare(
            requests,
            prof,
            settings,
            trace_name=trace.name,
            slo_ttft_s=slo_ttft,
            slo_itl_s=slo_itl,
            rate_scale=rate_scale,
            policies=names,
            routings=routings,
            static_replicas=replicas,
            tick_s=cfg.tick_s,
            warmup_s=min(cfg.warmup_s, requests[-1].at / 2),
            plot_path=plot,
            on_run=on_run,
            residency_shares=shares,
            best_fixed=best_fixed,
        )
    if output == OutputFormat.json:
        emit_json(report.model_dump())
        return
    _print(report, prof.name, rate_scale, shares)
    if plot is not None:
        typer.echo(f"plot: {plot}")


def _profile(
    name: str, cfg: SimulateConfig, kv_offloading_size: float | None, long_prefill_token_threshold: int | None
):
    """The profile, with the config's cold start, `--kv-offloading-size` GiB of host KV tier
    per replica (0: none) and `--long-prefill-token-threshold` (None: the profile's own)."""
    from fleet_base.profile import PerfProfile, load_profile

    try:
        prof = load_profile(name)
    except ValueError as err:
        fail(str(err))
    if cfg.cold_start_s is not None:
        prof = prof.model_copy(update={"cold_start_s": cfg.cold_start_s})
    overrides: dict[str, object] = {}
    flags = []
    if kv_offloading_size is not None:
        overrides["host_kv_bytes"] = int(kv_offloading_size * (1 << 30))
        flags.append(f"--kv-offloading-size {kv_offloading_size:g}")
    if long_prefill_token_threshold is not None:
        overrides["long_prefill_token_threshold"] = long_prefill_token_threshold
        flags.append(f"--long-prefill-token-threshold {long_prefill_token_threshold}")
    if not overrides:
        return prof
    try:
        return PerfProfile.model_validate({**prof.model_dump(), **overrides})
    except ValidationError as err:
        fail(f"{' '.join(flags)}: profile {prof.name}: {err.errors()[0]['msg']}")


def _pipeline(
    trace: Path,
    prof,
    cfg: SimulateConfig,
    settings,
    policy: str,
    slo_e2e: str | None,
    step_profiles: list[str],
    hop_ms: float,
    rate_scale: float,
    limit: float | None,
    output: OutputFormat,
) -> None:
    """A pipeline trace: every step its own deployment (its profile; the same settings)."""
    from rich.markup import escape

    from control_plane.commands.rollout import parse_duration
    from control_plane.simulate.pipeline import (
        StepSetup,
        compare_pipeline,
        trace_pipeline,
        trace_pipeline_name,
    )
    from control_plane.simulate.trace import TraceError, load_pipeline_trace
    from fleet_base.profile import load_profile

    if slo_e2e is None:
        fail("a pipeline trace needs --slo-e2e (the end-to-end budget, e.g. 20s)")
    budget = parse_duration(slo_e2e, "--slo-e2e")
    try:
        steps, requests = load_pipeline_trace(trace, rate_scale=rate_scale, limit_s=limit)
    except TraceError as err:
        fail(escape(str(err)))
    if not requests:
        fail(f"{trace}: no requests in the selected range")
    pipeline = trace_pipeline_name(trace.stem)
    try:
        trace_pipeline(pipeline, steps, budget)
    except ValueError as err:
        fail(escape(f"{trace} with --slo-e2e {slo_e2e}: not a valid pipeline: {err}"))
    profiles = {name: prof for name in steps}
    for item in step_profiles:
        name, sep, value = item.partition("=")
        if not sep or name not in profiles:
            fail(f"--step-profile {item!r}: expected STEP=PROFILE with STEP one of {', '.join(steps)}")
        try:
            profiles[name] = load_profile(value)
        except ValueError as err:
            fail(str(err))
        if cfg.cold_start_s is not None:
            profiles[name] = profiles[name].model_copy(update={"cold_start_s": cfg.cold_start_s})
    setups = [StepSetup(n, profiles[n], settings.model_copy(update={"profile": profiles[n]})) for n in steps]
    report = compare_pipeline(
        requests,
        setups,
        budget,
        pipeline=pipeline,
        policy=policy,
        hop_s=hop_ms / 1000,
        tick_s=cfg.tick_s,
        warmup_s=min(cfg.warmup_s, requests[-1].at / 2),
        trace_name=trace.name,
    )
    if output == OutputFormat.json:
        emit_json(report.model_dump())
        return
    columns = ["run", "gpu_hours", "e2e_p50_s", "e2e_p90_s", "within_budget", "budget_met", "budget_ticks"]
    rows = []
    for r in report.rows:
        row: dict[str, object] = {"run": f"{r.label} ({r.policy})", "gpu_hours": f"{r.gpu_hours:.2f}",
                                  "e2e_p50_s": r.e2e_p50_s, "e2e_p90_s": r.e2e_p90_s,
                                  "within_budget": f"{100 * r.within_budget:.1f}%",
                                  "budget_met": "yes" if r.budget_met else "no", "budget_ticks": r.budget_ticks}  # fmt: skip
        for name, st in r.steps.items():
            row |= {f"{name}_p50_s": st.p50_s, f"{name}_p90_s": st.p90_s, f"{name}_replicas": st.replicas_max}
        rows.append(row)
    for name in steps:
        columns += [f"{name}_p50_s", f"{name}_p90_s", f"{name}_replicas"]
    title = (
        f"{report.trace} x{rate_scale:g}: pipeline {' -> '.join(steps)}, {len(requests)} requests, budget "
        f"{budget:g}s e2e, hop {hop_ms:g}ms, profiles {', '.join(f'{n} {p.name}' for n, p in profiles.items())} "
        f"(warm-up not counted; simulated in {report.wall_s:.1f}s; replicas: the most held)"
    )
    _table(rows, title, columns)


def _shares(text: str | None) -> dict[str, float] | None:
    if text is None:
        return None
    from control_plane.simulate.residency import parse_shares

    try:
        return parse_shares(text)
    except ValueError as err:
        fail(f"--residency-shares: {err}")


def _print(report, profile: str, rate_scale: float, shares: dict[str, float] | None) -> None:
    """The comparison table, the static size and, with residency, what it costs."""
    rows = []
    best = report.best_fixed
    shown = list(report.policies)
    if best is not None:  # its own row, after the policies
        shown.append(
            best.summary.model_copy(
                update={
                    "policy": f"best fixed ({best.replicas})",
                    "gpu_hours_vs_best_fixed": 1.0,
                    "reaches_target": True,
                }
            )
        )
    if report.shared_cache_bound is not None:  # the references, after the policies
        shown.append(report.shared_cache_bound)
    for p in shown:
        row = p.model_dump(exclude={"timeline"})
        row["within_target"] = f"{100 * p.within_ttft_target:.2f}%"
        row["within_itl"] = f"{100 * p.within_itl_target:.2f}%"
        row["cost"] = f"${p.cost:,.2f}"
        row["gpu_hours"] = f"{p.gpu_hours:.2f}"
        row["cache_hit_rate"] = f"{100 * p.cache_hit_rate:.1f}%"
        row["host_hit_rate"] = f"{100 * p.host_hit_rate:.1f}%"
        row["hit_vs_ideal"] = None if p.hit_rate_vs_ideal is None else f"{p.hit_rate_vs_ideal:.2f}x"
        row["p90_vs_bound"] = None if p.ttft_p90_vs_bound is None else f"{p.ttft_p90_vs_bound:.2f}x"
        row["throughput_tok_s"] = f"{p.throughput_tok_s:,.0f}"
        ratio = p.gpu_hours_vs_best_fixed
        row["vs_best_fixed"] = None if ratio is None else f"{ratio:.2f}x"
        row["reaches_target"] = None if p.reaches_target is None else ("yes" if p.reaches_target else "no")
        rows.append(row)
    if report.ideal_reuse is not None:
        rows.append({"policy": "ideal reuse", "routing": "unlimited cache",
                     "cache_hit_rate": f"{100 * report.ideal_reuse:.1f}%", "hit_vs_ideal": "1.00x"})  # fmt: skip
    title = (
        f"{report.trace} x{rate_scale:g}: {report.requests} requests over {report.duration_s / 60:.1f} min, "
        f"{profile}, targets TTFT {report.slo_ttft_s:g}s, ITL {1000 * report.slo_itl_s:g}ms (first {report.warmup_s:g}s warm-up, not counted; "
        f"simulated in {report.wall_s:.1f}s)"
    )
    columns = COLUMNS if shares is None else [*COLUMNS[:2], "residency", *COLUMNS[2:]]
    for row in rows:
        row["residency"] = "per jurisdiction" if row.get("residency") else "none"
    _table(rows, title, columns)
    if report.static_replicas is not None:
        typer.echo(f"static: {report.static_replicas} replicas ({report.static_sizing})")
    device = f" (device KV {report.device_kv_gib:g} GiB)" if report.device_kv_gib else ""
    tier = (
        f"host KV tier {report.host_kv_gib:g} GiB, {report.host_kv_blocks:,} blocks per replica{device}"
        if report.host_kv_blocks
        else f"no host KV tier{device}"
    )
    if report.long_prefill_token_threshold:
        tier += f"; long-prefill cap {report.long_prefill_token_threshold:,} tokens a step"
    if report.shared_cache_bound is not None:
        typer.echo(
            f"{tier}; shared-cache bound: least-load on {report.static_replicas or 'the same'} replicas over one "
            f"cache of the fleet's device+host capacity; ideal reuse: one unlimited cache (docs/routing.md)"
        )
    if best is not None:
        typer.echo(
            f"best fixed fleet: {best.replicas} replicas, {best.gpu_hours:.2f} GPU-h, "
            f"{100 * best.within_ttft_target:.2f}% within TTFT {report.slo_ttft_s:g}s; "
            f"target {100 * best.target:.2f}% ({best.why})"
        )
    if report.residency_static_replicas:
        each = ", ".join(f"{j} {n}" for j, n in sorted(report.residency_static_replicas.items()))
        typer.echo(f"static under residency: {each} replicas (each jurisdiction sized for its own peak)")
    if shares is not None:
        from control_plane.simulate.residency import cost_lines

        for line in cost_lines(report):
            typer.echo(line)


def _table(rows: list[dict[str, object]], title: str, columns: list[str] = COLUMNS) -> None:
    """The comparison, wide enough for its columns even when piped."""
    from rich.console import Console
    from rich.table import Table

    from control_plane.commands.output import _cell

    table = Table(title=title, header_style="bold")
    for col in columns:
        table.add_column(
            col.replace("_s", " s").replace("_", " "),
            justify="left" if col in ("policy", "routing", "residency") else "right",
            no_wrap=col in ("policy", "routing"),
        )
    for row in rows:
        table.add_row(*[_cell(row.get(col)) for col in columns])
    Console(width=max(194, 194 + 12 * (len(columns) - len(COLUMNS)), Console().width)).print(table)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
