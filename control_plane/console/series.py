"""Time series for the console's charts, from what the control plane already has:

- a deployment's traffic: the usage records the gateways publish (one per request, with
  version, status, tokens and latency), bucketed per version;
- what the fleet's GPUs cost per hour, per deployment: the replica intervals (the cost
  ledger: each replica's lifetime at the price it started at), averaged over each bucket;
- a rollout's guards: the very samples the rollout policy judges (the rollout loop's
  in-memory `UsageWindows`, TTFT included), or the stored usage records when the loops
  run elsewhere (then a request's latency stands in for its TTFT, as the policy does
  for non-streamed requests), summarised like the policy does: over the step's window;
- the autoscaler's view of a deployment: the autoscale loop's recent decisions and its
  forecasts checked against the load that came (`control_plane.autoscale.prediction_error`),
  or the stored `scaled` events' decisions when the loops run elsewhere (no observed load then).

Output is uPlot's columnar shape: `{"x": [unix seconds...], "series": {label: [value or
None...]}}`, one x per bucket, so the page script hands it to the chart as it is."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.autoscale.prediction_error import Outcome
from control_plane.db.models import ReplicaInterval, UsageRecord
from control_plane.rollouts.telemetry import Sample, p90

MAX_ROWS = 100_000
MAX_BUCKETS = 90


@dataclass(frozen=True)
class Row:
    at: float
    version: int | None
    status: int
    completion_tokens: int
    latency_s: float  # the stored records hold no TTFT: a non-streamed request's TTFT is this


def usage_rows(session: Session, deployment: str, since: float) -> list[Row]:
    start = datetime.fromtimestamp(since, tz=timezone.utc)
    query = (
        select(
            UsageRecord.at,
            UsageRecord.version,
            UsageRecord.status,
            UsageRecord.completion_tokens,
            UsageRecord.latency_s,
        )
        .where(UsageRecord.deployment == deployment, UsageRecord.at >= start, UsageRecord.shadow.is_(False))
        .order_by(UsageRecord.at.desc())
        .limit(MAX_ROWS)
    )
    out = []
    for at, version, status, completion, latency in session.execute(query):
        stamp = (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()
        out.append(Row(stamp, version, status, completion or 0, latency or 0.0))
    return out


def step_for(span_s: float) -> float:
    """Bucket width: at most MAX_BUCKETS buckets, whole seconds, at least 1 s."""
    return float(max(1, math.ceil(span_s / MAX_BUCKETS)))


def _buckets(since: float, until: float, step: float) -> list[float]:
    first = math.floor(since / step) * step
    return [first + i * step for i in range(int((until - first) // step) + 1)]


def _grouped(rows: Iterable[Row], since: float, step: float) -> dict[tuple[int | None, int], list[Row]]:
    groups: dict[tuple[int | None, int], list[Row]] = defaultdict(list)
    first = math.floor(since / step) * step
    for r in rows:
        if r.at >= first:
            groups[(r.version, int((r.at - first) // step))].append(r)
    return groups


def deployment_series(rows: list[Row], since: float, until: float) -> dict[str, dict]:
    """Per version: requests/s, latency p50/p90 and latency per output token of the
    successful requests, output tokens/s. Keys are chart names."""
    if rows:  # no empty stretch before the first request
        since = max(since, min(r.at for r in rows))
    step = step_for(until - since)
    xs = _buckets(since, until, step)
    groups = _grouped(rows, since, step)
    versions = sorted({v for v, _ in groups}, key=lambda v: (v is None, v or 0))
    charts: dict[str, dict] = {
        name: {"x": xs, "series": {}} for name in ("latency", "itl", "tokens", "requests")
    }
    for v in versions:
        label = f"v{v}" if v is not None else "unknown"
        lat50, lat90, itl, tokens, reqs = [], [], [], [], []
        for i in range(len(xs)):
            bucket = groups.get((v, i), [])
            ok = [r for r in bucket if r.status < 400]
            lat = [r.latency_s for r in ok]
            lat50.append(_round(_quantile(lat, 0.5)))
            lat90.append(_round(p90(lat)))
            per_token = [r.latency_s / r.completion_tokens for r in ok if r.completion_tokens > 0]
            itl.append(_round(sum(per_token) / len(per_token)) if per_token else None)
            tokens.append(_round(sum(r.completion_tokens for r in ok) / step))
            reqs.append(_round(len(bucket) / step))
        charts["latency"]["series"][f"{label} p50"] = lat50
        charts["latency"]["series"][f"{label} p90"] = lat90
        charts["itl"]["series"][label] = itl
        charts["tokens"]["series"][label] = tokens
        charts["requests"]["series"][label] = reqs
    return charts


def guard_series(
    samples: list[Sample],
    baseline: int,
    canary: int,
    since: float,
    until: float,
    max_error_rate: float,
    max_ttft_ratio: float,
    windows: Sequence[float] = (),
) -> dict[str, dict]:
    """Canary vs baseline error rate and TTFT p90 as the rollout policy judges them: over
    the step's window so far (each time in `windows` starts a new one: the rollout's step
    changes), with each guard's line: `max_error_rate`, and the baseline's p90 times
    `max_ttft_p90_ratio`. A point is the window from its start to the bucket's end."""
    if samples:
        since = max(since, min(s.at for s in samples))
    step = step_for(until - since)
    xs = _buckets(since, until, step)
    starts = sorted(windows)
    ordered = sorted(samples, key=lambda s: s.at)
    errors: dict[str, list] = {"baseline": [], "canary": [], "guard: max error rate": []}
    ttft: dict[str, list] = {"baseline p90": [], "canary p90": [], "guard: baseline p90 x ratio": []}
    for x in xs:
        end = x + step
        opened = max((w for w in starts if w <= end), default=since)
        window = [s for s in ordered if opened <= s.at < end]
        base = [s for s in window if s.version == baseline]
        can = [s for s in window if s.version == canary]
        errors["baseline"].append(_rate(base))
        errors["canary"].append(_rate(can))
        errors["guard: max error rate"].append(max_error_rate)
        b90 = p90([s.ttft_s for s in base if s.ttft_s is not None])
        ttft["baseline p90"].append(_round(b90))
        ttft["canary p90"].append(_round(p90([s.ttft_s for s in can if s.ttft_s is not None])))
        ttft["guard: baseline p90 x ratio"].append(_round(b90 * max_ttft_ratio) if b90 else None)
    return {"errors": {"x": xs, "series": errors}, "ttft": {"x": xs, "series": ttft}}


def samples_of(rows: list[Row]) -> list[Sample]:
    """Stored usage rows as the rollout policy's samples (a 499 says nothing of a version)."""
    return [Sample(r.at, r.version, r.status >= 500, r.latency_s or None) for r in rows if r.status != 499]


def _rate(samples: list[Sample]) -> float | None:
    return _round(sum(1 for s in samples if s.error) / len(samples)) if samples else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


@dataclass(frozen=True)
class Held:
    deployment: str
    dollars_per_hour: float
    start: float
    end: float | None  # None: still running


def held_intervals(session: Session, since: float, until: float) -> list[Held]:
    """Replica intervals that overlap [since, until]."""
    start, end = (datetime.fromtimestamp(t, tz=timezone.utc) for t in (since, until))
    query = (
        select(
            ReplicaInterval.deployment,
            ReplicaInterval.gpus,
            ReplicaInterval.hourly_price,
            ReplicaInterval.started_at,
            ReplicaInterval.ended_at,
        )
        .where(
            ReplicaInterval.started_at <= end,
            (ReplicaInterval.ended_at.is_(None)) | (ReplicaInterval.ended_at >= start),
        )
        .limit(MAX_ROWS)
    )
    out = []
    for dep, gpus, price, started, ended in session.execute(query):
        out.append(Held(dep, (gpus or 0) * (price or 0.0), _stamp(started), ended and _stamp(ended)))
    return out


def _stamp(at: datetime) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()


def hourly_series(held: list[Held], since: float, until: float) -> dict[str, dict]:
    """Dollars per hour per deployment and in total, each bucket the average over its
    stretch inside the window (a replica that ran half of it counts half its price)."""
    step = step_for(until - since)
    xs = _buckets(since, until, step)
    names = sorted({h.deployment for h in held})
    series: dict[str, list] = {name: [0.0] * len(xs) for name in names}
    spans = [min(x + step, until) - max(x, since) for x in xs]  # the edge buckets are partial
    for h in held:
        end = until if h.end is None else h.end
        line = series[h.deployment]
        for i, x in enumerate(xs):
            overlap = min(x + step, end, until) - max(x, h.start, since)
            if overlap > 0 and spans[i] > 0:
                line[i] += h.dollars_per_hour * overlap / spans[i]
    total = [_round(sum(series[n][i] for n in names)) for i in range(len(xs))]
    out = {name: [_round(v) for v in values] for name, values in series.items()}
    return {"hourly": {"x": xs, "series": {**out, "total": total} if names else {}}}


# The autoscaler's view (`autoscale_series`): chart key -> (label, `predicted` key) per line.
PLAN_LINES = {
    "autoscale_fleet": (("burst fleet held", "burst_held"),),
    "autoscale_plan": (("cold start", "cold_start_s"), ("scale-down delay", "scale_down_delay_s"),
                       ("burst hold", "burst_hold_s")),
}  # fmt: skip
LOAD_CHARTS = (("autoscale_prompt", "prompt_tokens_per_s"), ("autoscale_requests", "requests_per_s"))


def autoscale_series(
    decisions: Sequence[tuple[float, int, Mapping[str, object]]],
    outcomes: Sequence[Outcome],
    since: float,
    until: float,
) -> dict[str, dict]:
    """The autoscaler's decisions `(at, desired, predicted)` and its checked forecasts over
    [since, until]: per signal, the load predicted for each time (made one horizon earlier)
    against the load observed then; the replicas wanted and the burst fleet held; the cold
    start, scale-down delay and burst hold it planned with; the smoothed MAPE per signal.
    A bucket holds the mean of its points (replicas: the most)."""
    firsts = [at for at, _, _ in decisions] + [o.observed_at for o in outcomes]
    if firsts:
        since = max(since, min(firsts))
    step = step_for(until - since)
    xs = _buckets(since, until, step)
    first = xs[0]

    def index(at: float) -> int | None:
        i = int((at - first) // step)
        return i if since <= at <= until and 0 <= i < len(xs) else None

    def line(points: Iterable[tuple[float, float]], reduce=lambda v: sum(v) / len(v)) -> list:
        buckets: dict[int, list[float]] = defaultdict(list)
        for at, value in points:
            i = index(at)
            if i is not None:
                buckets[i].append(value)
        return [_round(reduce(buckets[i])) if i in buckets else None for i in range(len(xs))]

    charts: dict[str, dict] = {}
    for key, signal in LOAD_CHARTS:
        checked = [o for o in outcomes if o.signal == signal]
        charts[key] = {"x": xs, "series": {
            "predicted": line((o.observed_at, o.predicted) for o in checked),
            "observed": line((o.observed_at, o.observed) for o in checked),
        } if checked else {}}  # fmt: skip
    fleet = {"replicas wanted": line(((at, float(n)) for at, n, _ in decisions), max)}
    for label, field in PLAN_LINES["autoscale_fleet"]:
        fleet[label] = line(_points(decisions, field), max)
    charts["autoscale_fleet"] = {"x": xs, "series": fleet if decisions else {}}
    plan = {label: line(_points(decisions, field)) for label, field in PLAN_LINES["autoscale_plan"]}
    charts["autoscale_plan"] = {
        "x": xs,
        "series": {k: v for k, v in plan.items() if any(x is not None for x in v)},
    }
    errors = {
        signal: line((o.observed_at, o.mape) for o in outcomes if o.signal == signal and o.mape is not None)
        for _, signal in LOAD_CHARTS
    }
    charts["autoscale_error"] = {
        "x": xs,
        "series": {k: v for k, v in errors.items() if any(x is not None for x in v)},
    }
    return charts


def _points(
    decisions: Iterable[tuple[float, int, Mapping[str, object]]], key: str
) -> list[tuple[float, float]]:
    out = []
    for at, _, predicted in decisions:
        value = predicted.get(key)
        if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value):
            out.append((at, float(value)))
    return out
