"""The autoscaling matrix: `fleetctl simulate` with its defaults on every timed trace in
`../shared/data` (the Azure 2023 conversation hour, the Mooncake trace) and on bursty
synthetic traces (`bench.bursty_trace`, several seeds), on each profile (default: the H100 and
the A100 Llama2-70B profiles) at each rate (1x and 1.5x), policies `ours` and `kpa`, every
run set read against its best fixed fleet (`control_plane.simulate.best_fixed`).

The rule a run set is held to: ours reaches the best fixed fleet's target (99% within the TTFT
target, or the ceiling a very large fleet reaches minus 0.5 points), at no more than 1.25x the
best fixed fleet's GPU-hours, and ahead of kpa on attainment (equal counts as ahead only when
both serve every request within target). One table per profile and rate, a row per trace.

    python -m bench.autoscale_matrix [--traces azure,mooncake,bursty] [--seeds 1,2,3]
        [--profiles llama2-70b-h100-tp4,llama2-70b-a100-tp4] [--rates 1,1.5] [--limit SECONDS]
        [--json out.json]

CPU-heavy (each run set simulates both policies and a handful of fixed fleets): run it alone,
niced. A benchmark: it measures and prints; it asserts nothing."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel

from bench.bursty_trace import generate, write_csv
from bench.inputs import data_dir

TIMED_TRACES = {"azure": "azure2023_conv.csv", "mooncake": "mooncake_synthetic_trace.jsonl"}
DEFAULT_PROFILES = ("llama2-70b-h100-tp4", "llama2-70b-a100-tp4")
COST_BOUND = 1.25  # ours may spend this many times the best fixed fleet's GPU-hours


class PolicyRow(BaseModel):
    within_ttft_target: float
    gpu_hours: float
    cold_starts: int


class RunSet(BaseModel):
    trace: str
    profile: str
    rate: float
    requests: int
    ours: PolicyRow
    kpa: PolicyRow
    best_replicas: int
    best_gpu_hours: float
    best_within: float
    target: float
    target_basis: str
    ours_vs_best: float
    meets: bool
    misses: list[str]  # which parts of the rule ours misses
    wall_s: float


def verdict(ours: PolicyRow, kpa: PolicyRow, target: float, best_gpu_hours: float) -> list[str]:
    """The parts of the rule ours misses (none: it meets it)."""
    misses = []
    if ours.within_ttft_target < target:
        misses.append("target")
    if ours.gpu_hours > COST_BOUND * best_gpu_hours:
        misses.append(f"> {COST_BOUND:g}x")
    both_full = ours.within_ttft_target >= 1.0 and kpa.within_ttft_target >= 1.0
    if ours.within_ttft_target <= kpa.within_ttft_target and not both_full:
        misses.append("not ahead of kpa")
    return misses


def run_set(path: Path, name: str, profile: str, rate: float, limit: float | None) -> RunSet:
    """`fleetctl simulate --trace PATH --profile P --rate-scale R --policies kpa,ours` with the
    command's defaults otherwise."""
    from control_plane.commands.simulate import SimulateConfig
    from control_plane.simulate import compare, default_settings, load_trace
    from fleet_base.profile import load_profile

    prof = load_profile(profile)
    requests = load_trace(path, rate_scale=rate, limit_s=limit)
    defaults = SimulateConfig()
    started = time.perf_counter()
    rep = compare(
        requests,
        prof,
        default_settings(prof),
        trace_name=name,
        rate_scale=rate,
        policies=("kpa", "ours"),
        tick_s=defaults.tick_s,
        warmup_s=min(defaults.warmup_s, requests[-1].at / 2),
    )
    by = {
        p.policy: PolicyRow(
            within_ttft_target=p.within_ttft_target, gpu_hours=p.gpu_hours, cold_starts=p.cold_starts
        )
        for p in rep.policies
    }
    best = rep.best_fixed
    assert best is not None  # compare searches it by default
    misses = verdict(by["ours"], by["kpa"], best.target, best.gpu_hours)
    return RunSet(
        trace=name,
        profile=profile,
        rate=rate,
        requests=rep.requests,
        ours=by["ours"],
        kpa=by["kpa"],
        best_replicas=best.replicas,
        best_gpu_hours=best.gpu_hours,
        best_within=best.within_ttft_target,
        target=best.target,
        target_basis=best.target_basis,
        ours_vs_best=round(by["ours"].gpu_hours / best.gpu_hours, 3) if best.gpu_hours else float("inf"),
        meets=not misses,
        misses=misses,
        wall_s=round(time.perf_counter() - started, 1),
    )


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def print_group(profile: str, rate: float, sets: list[RunSet]) -> None:
    from bench.common import print_table

    rows = [
        [
            s.trace,
            s.requests,
            _pct(s.ours.within_ttft_target),
            f"{s.ours.gpu_hours:.2f}",
            s.ours.cold_starts,
            _pct(s.kpa.within_ttft_target),
            f"{s.kpa.gpu_hours:.2f}",
            s.kpa.cold_starts,
            s.best_replicas,
            f"{s.best_gpu_hours:.2f}",
            _pct(s.best_within),
            _pct(s.target) + ("" if s.target_basis == "99%" else " (ceiling - 0.5)"),
            f"{s.ours_vs_best:.2f}x",
            "yes" if s.meets else "no: " + ", ".join(s.misses),
        ]
        for s in sets
    ]
    met = sum(s.meets for s in sets)
    print_table(
        f"{profile} x{rate:g}: ours against its best fixed fleet ({met} of {len(sets)} meet the rule)",
        [
            "trace",
            "requests",
            "ours within",
            "ours GPU-h",
            "ours cold",
            "kpa within",
            "kpa GPU-h",
            "kpa cold",
            "best fixed N",
            "best GPU-h",
            "best within",
            "target",
            "ours/best GPU-h",
            "ours meets rule",
        ],
        rows,
        caption=f"rule: ours >= target, <= {COST_BOUND:g}x the best fixed fleet's GPU-h, ahead of kpa on attainment",
        min_width=260,
    )


def traces(
    names: list[str], seeds: list[int], folder: Path, duration_s: float, shape: str
) -> list[tuple[str, Path]]:
    """(name, file) of every trace asked for that is there; absent data files are said and skipped."""
    data = data_dir()
    out = []
    for name in names:
        if name == "bursty":
            for seed in seeds:
                path = folder / f"bursty-{shape}-s{seed}.csv"
                write_csv(generate(duration_s, seed, shape), path)
                out.append((path.stem, path))
        elif name in TIMED_TRACES:
            path = data / TIMED_TRACES[name]
            if path.is_file():
                out.append((path.stem, path))
            else:
                print(
                    f"skipped {name}: {path} is absent (the shared data in ../shared/data; "
                    "set FLEET_SHARED_DATA to the folder holding it)",
                    file=sys.stderr,
                )
        else:
            raise SystemExit(f"unknown trace {name!r}; known: {', '.join([*TIMED_TRACES, 'bursty'])}")
    return out


def main(argv: list[str] | None = None) -> list[RunSet]:
    p = argparse.ArgumentParser(
        prog="python -m bench.autoscale_matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--traces", default="azure,mooncake,bursty", help="of azure, mooncake, bursty")
    p.add_argument("--seeds", default="1,2,3", help="seeds of the bursty traces")
    p.add_argument("--shape", default="code", help="the bursty traces' shape (bench.bursty_trace)")
    p.add_argument("--duration-s", type=float, default=3600.0, help="the bursty traces' length")
    p.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    p.add_argument("--rates", default="1,1.5")
    p.add_argument("--limit", type=float, default=None, help="only the first SECONDS of each (scaled) trace")
    p.add_argument("--json", type=Path, default=None, help="write every run set here")
    args = p.parse_args(argv)
    names = [x.strip() for x in args.traces.split(",") if x.strip()]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    profiles = [x.strip() for x in args.profiles.split(",") if x.strip()]
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    results: list[RunSet] = []
    with tempfile.TemporaryDirectory(prefix="autoscale-matrix-") as tmp:
        found = traces(names, seeds, Path(tmp), args.duration_s, args.shape)
        for profile in profiles:
            for rate in rates:
                group = []
                for name, path in found:
                    s = run_set(path, name, profile, rate, args.limit)
                    print(
                        f"{profile} x{rate:g} {name}: ours {_pct(s.ours.within_ttft_target)} at "
                        f"{s.ours.gpu_hours:.2f} GPU-h, best fixed {s.best_replicas} at {s.best_gpu_hours:.2f} "
                        f"GPU-h ({s.wall_s:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    group.append(s)
                results += group
                print_group(profile, rate, group)
                sys.stdout.flush()
    met = sum(s.meets for s in results)
    print(f"ours meets the rule on {met} of {len(results)} run sets")
    if args.json is not None:
        args.json.write_text("[\n" + ",\n".join(s.model_dump_json() for s in results) + "\n]\n")
    return results


if __name__ == "__main__":
    main()
