"""Residency in `fleetctl simulate`: what it costs to keep each jurisdiction's requests on
its own replicas instead of one shared fleet.

`--residency-shares ca=0.3,us=0.7` says which share of the trace's requests is bound to
each jurisdiction (an API key's or a deployment's policy). Under the policy each
jurisdiction's requests are served only by replicas there: the trace is split (each
request drawn to a jurisdiction by its share, seeded, so every run splits alike) and each
part runs on its own autoscaled (or statically sized) fleet; the runs are then merged
into one (GPU time, cold starts and replicas add up; every request keeps its own
latency). Without the policy the whole trace shares one fleet. The difference is the
cost of residency: fleets that cannot pool their load hold more idle capacity, start
more replicas and share fewer cached prefixes. Network distance is not simulated here
(`fleetctl plan` reports round trips to clients)."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from control_plane.simulate.des import RunResult, Sample
from control_plane.simulate.report import SimulationReport
from control_plane.simulate.trace import TraceRequest
from fleet_base.residency import normalize

SPLIT_SEED = 36


def parse_shares(text: str) -> dict[str, float]:
    """`ca=0.3,us=0.7` -> {"ca": 0.3, "us": 0.7} (weights, normalised to sum to 1).
    ValueError on a bad label, a weight that is not a positive number, or a repeat."""
    out: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",")):
        label, sep, weight = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is not JURISDICTION=SHARE")
        name = normalize(label)
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"{entry!r}: the share {weight!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{entry!r}: a share must be a positive number")
        if name in out:
            raise ValueError(f"jurisdiction {name!r} is given twice")
        out[name] = value
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def split_trace(trace: Sequence[TraceRequest], shares: dict[str, float]) -> dict[str, list[TraceRequest]]:
    """Each request to one jurisdiction, drawn by its share (seeded), in trace order."""
    names = sorted(shares)
    weights = [shares[n] for n in names]
    rng = random.Random(SPLIT_SEED)
    out: dict[str, list[TraceRequest]] = {n: [] for n in names}
    for request in trace:
        out[rng.choices(names, weights)[0]].append(request)
    return out


def merge(runs: Sequence[RunResult]) -> RunResult:
    """Separate fleets' runs as one: requests side by side, GPU time and cold starts added,
    and at every sample time the replicas (and demand) of all fleets summed, each fleet
    counting its latest sample."""
    first = runs[0]
    times = sorted({s.at for r in runs for s in r.samples})
    index = [[s.at for s in r.samples] for r in runs]
    samples = []
    for t in times:
        now = [
            r.samples[i - 1] for r, at in zip(runs, index, strict=True) if (i := bisect.bisect_right(at, t))
        ]
        samples.append(
            Sample(
                at=t,
                replicas=sum(s.replicas for s in now),
                ready=sum(s.ready for s in now),
                desired=sum(s.desired for s in now),
                demand=sum(s.demand for s in now),
                arrivals=sum(s.arrivals for s in now if s.at == t),
            )
        )
    return RunResult(
        policy=first.policy,
        requests=[q for r in runs for q in r.requests],
        samples=samples,
        replica_seconds=sum(r.replica_seconds for r in runs),
        cold_starts=sum(r.cold_starts for r in runs),
        decisions=sorted(d for r in runs for d in r.decisions),
        end=max(r.end for r in runs),
        warmup_s=first.warmup_s,
        routing=first.routing,
    )


def describe_shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(shares.items()))


def cost_lines(report: SimulationReport) -> list[str]:
    """Per policy and routing: what keeping each jurisdiction's requests on its own fleet
    costs against one shared fleet (GPU-hours, TTFT, the share within target)."""
    shared = {(p.policy, p.routing): p for p in report.policies if not p.residency}
    out = []
    for p in report.policies:
        base = shared.get((p.policy, p.routing))
        if not p.residency or base is None:
            continue
        pct = f" ({100 * (p.gpu_hours / base.gpu_hours - 1):+.1f}%)" if base.gpu_hours else ""
        out.append(
            f"residency ({p.residency}) {p.policy}/{p.routing}: "
            f"{p.gpu_hours - base.gpu_hours:+.2f} GPU-hours{pct}, {p.cost - base.cost:+,.2f} $, "
            f"TTFT p50 {p.ttft_p50_s - base.ttft_p50_s:+.3f} s, p99 {p.ttft_p99_s - base.ttft_p99_s:+.3f} s, "
            f"within TTFT target {100 * (p.within_ttft_target - base.within_ttft_target):+.2f} points, "
            f"cold starts {p.cold_starts - base.cold_starts:+d}"
        )
    return out
