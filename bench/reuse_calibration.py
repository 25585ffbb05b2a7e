"""The capacity model against the simulator on a trace whose prompts share prefixes, at fixed
fleets: the share of prompt tokens the fleet's caches serve, and the TTFT attainment.

The SLO policy's model today prefills every prompt token (it sees no reuse). With each
prompt's reuse curve (`fleet_base.reuse_curve`: one LRU stack-distance pass answers what a
cache of any size holds of it), a fleet of n replicas is credited with what one LRU of their
n caches would hold (`control_plane.autoscale.reuse`). The simulator runs the same trace on
the same fixed fleet (its replicas' own caches, the gateway's prefix routing) and counts.

    python -m bench.reuse_calibration [--trace PATH] [--profiles h100,a100]
        [--fleets 8,13,20,26,32,43] [--rate 1]

The trace defaults to the Mooncake trace in FLEET_SHARED_DATA (or ../shared/data); the first
300 s (at most half the trace) warm the fleet up and are not counted, as `fleetctl simulate`
does. A benchmark: it measures and prints; it asserts nothing."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

PROFILES = {"h100": "llama2-70b-h100-tp4", "a100": "llama2-70b-a100-tp4"}
WARMUP_S = 300.0


def _default_trace() -> Path:
    root = Path(os.environ.get("FLEET_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    return root / "mooncake_synthetic_trace.jsonl"


def rows(trace_path: Path, profile_name: str, fleets: list[int], rate: float) -> list[dict[str, float]]:
    """Per fleet size: the simulator's reuse and attainment against the model's, with and
    without the fleet's reuse."""
    from control_plane.autoscale.capacity import Load, ReplicaCapacity
    from control_plane.autoscale.reuse import FleetReuse, at_fleet, fleet_cache_tokens
    from control_plane.simulate import default_settings, load_trace
    from control_plane.simulate.des import Simulation
    from fleet_base.profile import load_profile
    from fleet_base.reuse_curve import ReuseCurves

    profile = load_profile(profile_name)
    trace = load_trace(trace_path, rate_scale=rate)
    block = next((q.block_tokens for q in trace if q.hash_ids), 0)
    if not block:
        raise SystemExit(f"{trace_path}: no prompt blocks (hash_ids): nothing is reused")
    settings = default_settings(profile)
    warm = min(WARMUP_S, trace[-1].at / 2)
    curves = ReuseCurves(int(fleet_cache_tokens(profile, max(fleets))), block)
    seen = [curves.observe(q.hash_ids, q.prompt_tokens) for q in trace]
    counted = [i for i, q in enumerate(trace) if q.at >= warm]
    span = trace[-1].at - warm
    measured = [trace[i] for i in counted]
    load = Load(
        len(measured) / span,
        sum(q.prompt_tokens for q in measured) / span,
        sum(q.output_tokens for q in measured) / span,
    )
    prompts = [q.prompt_tokens for q in measured]
    reuse = FleetReuse(tuple(prompts), tuple(seen[i] for i in counted))
    cap = ReplicaCapacity(profile)
    target = settings.slo_ttft_s
    out = []
    for n in fleets:
        fixed = settings.model_copy(update={"min_replicas": n, "max_replicas": n})
        run = Simulation(trace, profile, fixed, "static", initial_replicas=n, warmup_s=warm).run()
        done = [q for q in run.requests if q.arrival >= warm]
        within = sum(
            1 for q in done if q.first_token_at is not None and q.first_token_at - q.arrival <= target
        )
        plain = cap.predict(load, n, 1.0, prompts, target)
        at, fresh = at_fleet(load, prompts, reuse, profile, n)
        credited = cap.predict(at, n, 1.0, fresh, target)
        out.append({
            "fleet": n,
            "sim_reuse": sum(q.cached_tokens for q in done) / max(1, sum(q.prompt_tokens for q in done)),
            "model_reuse": at.prefix_reuse,
            "sim_within": within / max(1, len(done)),
            "model_within": credited.attainment,
            "model_attainable": credited.attainable,
            "plain_within": plain.attainment,
            "plain_attainable": plain.attainable,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--profiles", default="h100,a100")
    ap.add_argument("--fleets", default="8,13,20,26,32,43")
    ap.add_argument("--rate", type=float, default=1.0)
    args = ap.parse_args(argv)
    trace = args.trace or _default_trace()
    fleets = sorted({int(x) for x in args.fleets.split(",") if x.strip()})
    console = Console(width=max(120, Console().width))
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    for key in args.profiles.split(","):
        profile = PROFILES.get(key.strip(), key.strip())
        table = Table(
            title=f"{trace.name} x{args.rate:g} on {profile}: the capacity model against the simulator",
            caption="model: credited with one LRU of the fleet's caches; no-reuse: every prompt token "
            "prefilled (the SLO policy's model today). within: share of requests within the TTFT target",
        )
        for col in ("fleet", "sim reuse", "model reuse", "sim within", "model within", "model attainable",
                    "no-reuse within", "no-reuse attainable"):  # fmt: skip
            table.add_column(col, justify="right")
        for r in rows(trace, profile, fleets, args.rate):
            table.add_row(
                str(r["fleet"]),
                pct(r["sim_reuse"]),
                pct(r["model_reuse"]),
                pct(r["sim_within"]),
                pct(r["model_within"]),
                pct(r["model_attainable"]),
                pct(r["plain_within"]),
                pct(r["plain_attainable"]),
            )
        console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
