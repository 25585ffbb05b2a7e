"""The burst memory's queue model against the simulator: after `ours` ran a bursty trace, its
memory holds every 2 s slice of the hour; replayed undecayed at a fixed fleet, the model says
what share of the requests that can meet the TTFT target would miss it. The simulator runs the
same trace on that fixed fleet and counts. A model that says more than the simulator holds
more replicas through a lull than it needs; one that says less holds too few.

    python -m bench.burst_calibration [--sets code:1:h100:1,code:3:a100:1,...]
        [--fleets -2,-1,0,1,3]

A set is shape:seed:profile:rate (profile h100 or a100, the Llama2-70B TP4 profiles);
fleets are offsets from the best fixed fleet's count for that set (the search `fleetctl
simulate` runs, over the whole hour). A benchmark: it measures and prints; it asserts nothing."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.bursty_trace import generate, write_csv

PROFILES = {"h100": "llama2-70b-h100-tp4", "a100": "llama2-70b-a100-tp4"}
DEFAULT_SETS = "code:1:h100:1,code:3:a100:1,code:4:h100:1,dense:2:h100:1,sharp:1:h100:1,code:2:a100:1.5"


def _missed_share(requests, profile, ttft_s: float) -> float:
    """Of the requests whose own prefill fits the target, the share that missed it."""
    fits = [q for q in requests if profile.prefill_time(q.prompt_tokens) <= ttft_s]
    missed = sum(1 for q in fits if q.first_token_at is None or q.first_token_at - q.arrival > ttft_s)
    return missed / len(fits) if fits else 0.0


def _model_share(memory, fleet: int) -> float:
    """The memory's own answer at `fleet`: the allowance at which its held fleet would be
    `fleet`, found by bisection on the share (undecayed: every slice weighs alike)."""
    from control_plane.autoscale import burst

    saved = burst.MEMORY_S
    burst.MEMORY_S = 1e12
    try:
        t = memory.windows[-1][0]
        lo, hi = 0.0, 1.0
        for _ in range(24):
            mid = (lo + hi) / 2
            if _fleet_at(memory, t, mid) <= fleet:
                hi = mid
            else:
                lo = mid
        return hi
    finally:
        burst.MEMORY_S = saved


def _fleet_at(memory, t: float, share: float) -> int:
    """The held fleet with the miss budget set to `share` of the attainable requests."""
    memory.miss_budget = share
    return memory._fleet(t)


def calibrate(shape: str, seed: int, profile_key: str, rate: float, offsets: list[int], work: Path):
    """(the best fixed fleet's count, [(fleet, simulator's share, model's share)])."""
    from control_plane.simulate import default_settings, load_trace
    from control_plane.simulate.best_fixed import search
    from control_plane.simulate.des import Simulation
    from control_plane.simulate.report import summarize
    from fleet_base.profile import load_profile

    path = work / f"bursty-{shape}-s{seed}.csv"
    write_csv(generate(3600.0, seed, shape), path)
    profile = load_profile(PROFILES[profile_key])
    trace = load_trace(path, rate_scale=rate)
    settings = default_settings(profile)
    ours = Simulation(trace, profile, settings, "ours", tick_s=2.0, initial_replicas=1, warmup_s=0)
    peak = max((s.desired for s in ours.run().samples), default=1)
    memory = ours.state.memory["ours"].burst
    runs = {}

    def static(n: int):
        if n not in runs:
            fixed = settings.model_copy(update={"min_replicas": n, "max_replicas": n})
            runs[n] = Simulation(
                trace, profile, fixed, "static", tick_s=2.0, initial_replicas=n, warmup_s=0
            ).run()
        return runs[n]

    best = search(
        lambda n: summarize(static(n), profile, settings.slo_ttft_s, slo_itl_s=settings.slo_itl_s),
        max(1, peak),
    ).replicas
    rows = []
    for off in offsets:
        n = best + off
        if n >= 1:
            rows.append(
                (n, _missed_share(static(n).requests, profile, settings.slo_ttft_s), _model_share(memory, n))
            )
    return best, rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=DEFAULT_SETS)
    p.add_argument("--fleets", default="-2,-1,0,1,3")
    args = p.parse_args(argv)
    offsets = [int(x) for x in args.fleets.split(",")]
    console = Console()
    table = Table(title="burst memory vs simulator: missed share of attainable requests at a fixed fleet")
    for col in ("set", "best fixed", "fleet", "simulator", "model", "model / simulator"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.sets.split(","):
            shape, seed, prof, rate = spec.split(":")
            best, rows = calibrate(shape, int(seed), prof, float(rate), offsets, Path(tmp))
            for n, sim, model in rows:
                ratio = f"{model / sim:.1f}x" if sim > 0 else "-"
                table.add_row(spec, str(best), str(n), f"{100 * sim:.2f}%", f"{100 * model:.2f}%", ratio)
            console.print(f"{spec}: done", style="dim")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
