"""The cost rules as pure functions over plain rows: replica intervals, the pools' current
reserved commitments and usage records in, a `CostReport` out. No database here
(`control_plane.cost.report` reads the rows), so every rule is a table test.

The rules (docs/cost.md, "How cost is computed"):

- An on-demand or spot replica costs `gpus * hourly_price * hours` for the part of its
  interval inside the window; a spot interruption ends its interval (nothing after it is
  paid). `hourly_price` is per GPU-hour, copied from the pool when the replica started.
- A reserved pool is paid for the whole window, `gpus * hourly_price * window hours`,
  used or not: the replicas on it are charged as above, and the GPU-hours left over are
  the pool's unused reserved capacity, charged to no deployment ("(unallocated)").
- A deployment's utilisation is its busy seconds (the sum of its requests' latency)
  over its replica-held seconds, at most 1; that fraction of its dollars is busy, the
  rest `idle_dollars`.
- By key or team, a deployment's dollars (idle part included) are split over the keys
  that used it in proportion to their busy seconds; shadow copies' share goes to
  "(shadow)" (the deployment's own cost, never a key's), and a deployment nobody used in
  the window goes to "(unallocated)".
- By pool, a deployment's usage is split over the pools it ran on in proportion to its
  GPU-seconds there.
- Prefill time is a request's ttft_s (its latency when there is none), decode time the
  rest of its latency; a row's $/Mtok per phase splits its dollars by those times.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from control_plane.cost.model import NO_TEAM, CostReport, CostRow, GroupBy

SHADOW = "(shadow)"  # shadow copies: their deployment's cost, never a key's
UNALLOCATED = "(unallocated)"  # unused reserved capacity, and deployments nobody used
RESERVED = "reserved"


@dataclass(frozen=True)
class Interval:
    """One replica's time on a pool (a `replica_intervals` row), times in Unix seconds."""

    deployment: str
    cluster: str
    pool: str
    tier: str
    gpus: int
    hourly_price: float  # per GPU-hour
    started_at: float
    ended_at: float | None = None  # None: still running


@dataclass(frozen=True)
class PoolPrice:
    """A pool as it is now: reserved pools are paid for every GPU, used or not."""

    cluster: str
    pool: str
    tier: str
    gpus: int  # nodes * gpus_per_node
    hourly_price: float  # per GPU-hour


@dataclass(frozen=True)
class Usage:
    """Requests of one key on one deployment (one stored request, or the sums of many),
    with the key's team; their time already split into prefill and decode."""

    key_id: str
    deployment: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    requests: int = 1
    shadow: bool = False
    team: str | None = None


def overlap_s(start: float, end: float | None, since: float, until: float) -> float:
    """Seconds of [start, end) inside [since, until); an open interval runs to `until`."""
    stop = until if end is None else min(end, until)
    return max(0.0, stop - max(start, since))


def phase_seconds(latency_s: float, ttft_s: float | None) -> tuple[float, float]:
    """(prefill_s, decode_s): prefill is the time to the first token (the whole latency
    when none was measured), decode the rest."""
    latency = max(0.0, latency_s)
    prefill = latency if ttft_s is None else min(max(0.0, ttft_s), latency)
    return prefill, latency - prefill


def request(
    key_id: str,
    deployment: str,
    prompt_tokens: int,
    completion_tokens: int,
    latency_s: float,
    ttft_s: float | None = None,
    *,
    shadow: bool = False,
    team: str | None = None,
) -> Usage:
    """One request's usage (`phase_seconds` splits its time)."""
    prefill, decode = phase_seconds(latency_s, ttft_s)
    return Usage(key_id, deployment, prompt_tokens, completion_tokens, prefill, decode, 1, shadow, team)


@dataclass
class _Charge:
    """GPU time and dollars, splittable by a fraction."""

    gpu_h: float = 0.0
    idle_gpu_h: float = 0.0
    dollars: float = 0.0
    idle_dollars: float = 0.0
    by_tier: dict[str, float] = field(default_factory=dict)

    def add(self, other: _Charge, share: float = 1.0) -> None:
        self.gpu_h += other.gpu_h * share
        self.idle_gpu_h += other.idle_gpu_h * share
        self.dollars += other.dollars * share
        self.idle_dollars += other.idle_dollars * share
        for tier, d in other.by_tier.items():
            self.by_tier[tier] = self.by_tier.get(tier, 0.0) + d * share


@dataclass
class _Work:
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    requests: float = 0.0

    def add(self, u: Usage | _Work, share: float = 1.0) -> None:
        self.prompt_tokens += u.prompt_tokens * share
        self.completion_tokens += u.completion_tokens * share
        self.prefill_s += u.prefill_s * share
        self.decode_s += u.decode_s * share
        self.requests += u.requests * share

    @property
    def busy_s(self) -> float:
        return self.prefill_s + self.decode_s


def per_mtok(dollars: float, work: _Work) -> dict[str, float | None]:
    """$/Mtok per phase: dollars split by prefill vs decode time, each over its tokens."""
    busy = work.busy_s
    prefill_d = dollars * work.prefill_s / busy if busy > 0 else None
    decode_d = dollars * work.decode_s / busy if busy > 0 else None
    tokens = work.prompt_tokens + work.completion_tokens

    def rate(d: float | None, n: float) -> float | None:
        return None if d is None or n <= 0 else d / n * 1e6

    return {
        "prefill": rate(prefill_d, work.prompt_tokens),
        "decode": rate(decode_d, work.completion_tokens),
        "total": rate(dollars, tokens),
    }


def _row(group: str, charge: _Charge, work: _Work) -> CostRow:
    return CostRow(
        group=group,
        gpu_hours=charge.gpu_h,
        gpu_dollars=charge.dollars,
        dollars_by_tier=dict(sorted(charge.by_tier.items())),
        idle_dollars=charge.idle_dollars,
        prompt_tokens=round(work.prompt_tokens),
        completion_tokens=round(work.completion_tokens),
        prefill_s=work.prefill_s,
        decode_s=work.decode_s,
        requests=round(work.requests),
        utilisation=None if charge.gpu_h <= 0 else (charge.gpu_h - charge.idle_gpu_h) / charge.gpu_h,
        dollars_per_mtok=per_mtok(charge.dollars, work),
    )


def _interval_charge(iv: Interval, since: float, until: float) -> tuple[_Charge, float]:
    """The interval's charge inside the window (idle not yet known) and its held seconds."""
    held = overlap_s(iv.started_at, iv.ended_at, since, until)
    dollars = iv.gpus * iv.hourly_price * held / 3600
    return _Charge(gpu_h=iv.gpus * held / 3600, dollars=dollars, by_tier={iv.tier: dollars}), held


def _with_idle(charge: _Charge, utilisation: float) -> _Charge:
    idle = 1.0 - utilisation
    return _Charge(
        gpu_h=charge.gpu_h,
        idle_gpu_h=charge.gpu_h * idle,
        dollars=charge.dollars,
        idle_dollars=charge.dollars * idle,
        by_tier=dict(charge.by_tier),
    )


def _unused_reserved(
    pools: Iterable[PoolPrice], intervals: Iterable[Interval], since: float, until: float
) -> dict[str, _Charge]:
    """ "cluster/pool" -> the reserved GPU-hours no replica held in the window (all idle)."""
    used: dict[tuple[str, str], float] = defaultdict(float)
    for iv in intervals:
        used[(iv.cluster, iv.pool)] += iv.gpus * overlap_s(iv.started_at, iv.ended_at, since, until)
    out: dict[str, _Charge] = {}
    for p in pools:
        if p.tier != RESERVED:
            continue
        unused_h = max(0.0, p.gpus * (until - since) - used[(p.cluster, p.pool)]) / 3600
        dollars = unused_h * p.hourly_price
        out[f"{p.cluster}/{p.pool}"] = _Charge(
            gpu_h=unused_h,
            idle_gpu_h=unused_h,
            dollars=dollars,
            idle_dollars=dollars,
            by_tier={RESERVED: dollars},
        )
    return out


def deployment_charges(
    intervals: Iterable[Interval], work_of: dict[str, _Work], since: float, until: float
) -> dict[str, dict[str, _Charge]]:
    """deployment -> "cluster/pool" -> its charge there in the window, the idle part set
    from the deployment's utilisation (busy seconds / replica-held seconds, at most 1)."""
    raw: dict[str, dict[str, tuple[_Charge, float]]] = defaultdict(dict)
    for iv in intervals:
        charge, held = _interval_charge(iv, since, until)
        if held <= 0:
            continue
        key = f"{iv.cluster}/{iv.pool}"
        have, have_held = raw[iv.deployment].get(key, (_Charge(), 0.0))
        have.add(charge)
        raw[iv.deployment][key] = (have, have_held + held)
    out: dict[str, dict[str, _Charge]] = {}
    for dep, by_pool in raw.items():
        held = sum(h for _, h in by_pool.values())
        busy = work_of[dep].busy_s if dep in work_of else 0.0
        utilisation = min(1.0, busy / held) if held > 0 else 0.0
        out[dep] = {p: _with_idle(c, utilisation) for p, (c, _) in by_pool.items()}
    return out


def build_report(
    intervals: Iterable[Interval],
    pools: Iterable[PoolPrice],
    usage: Iterable[Usage],
    since: float,
    until: float,
    by: GroupBy,
) -> CostReport:
    """The window's GPU dollars and work, grouped `by` (the rules are this module's)."""
    if not until > since:
        raise ValueError("the window must end after it starts")
    intervals, usage = list(intervals), list(usage)
    work_of: dict[str, _Work] = defaultdict(_Work)
    for u in usage:
        work_of[u.deployment].add(u)
    per_pool = deployment_charges(intervals, work_of, since, until)
    unused = _unused_reserved(pools, intervals, since, until)

    charges: dict[str, _Charge] = defaultdict(_Charge)
    works: dict[str, _Work] = defaultdict(_Work)
    if by == "pool":
        _by_pool(per_pool, work_of, unused, charges, works)
    else:
        for c in unused.values():
            charges[UNALLOCATED].add(c)
        dep_charge: dict[str, _Charge] = defaultdict(_Charge)
        for dep, by_pool in per_pool.items():
            for c in by_pool.values():
                dep_charge[dep].add(c)
        if by == "deployment":
            for dep, c in dep_charge.items():
                charges[dep].add(c)
            for dep, work in work_of.items():
                works[dep].add(work)
        else:
            _charge_back(by, usage, dep_charge, work_of, charges, works)

    groups = sorted(set(charges) | set(works))
    rows = [_row(g, charges[g], works[g]) for g in groups]
    rows.sort(key=lambda r: (-r.gpu_dollars, r.group))
    total_charge, total_work = _Charge(), _Work()
    for g in groups:
        total_charge.add(charges[g])
    for u in usage:
        total_work.add(u)
    return CostReport(
        since=since,
        until=until,
        by=by,
        rows=rows,
        total=_row("total", total_charge, total_work),
        hourly_dollars=total_charge.dollars / ((until - since) / 3600),
    )


def _by_pool(
    per_pool: dict[str, dict[str, _Charge]],
    work_of: dict[str, _Work],
    unused: dict[str, _Charge],
    charges: dict[str, _Charge],
    works: dict[str, _Work],
) -> None:
    """Each pool: its replicas' charges and unused reserved capacity; a deployment's usage
    split over its pools by GPU-hours (usage with no GPU time: "(unallocated)")."""
    for dep, by_pool in per_pool.items():
        gpu_h = sum(c.gpu_h for c in by_pool.values())
        for pool, c in by_pool.items():
            charges[pool].add(c)
            works[pool].add(work_of[dep], c.gpu_h / gpu_h if gpu_h > 0 else 0.0)
    for dep, work in work_of.items():
        if dep not in per_pool:
            works[UNALLOCATED].add(work)
    for pool, c in unused.items():
        charges[pool].add(c)


def _charge_back(
    by: GroupBy,
    usage: list[Usage],
    dep_charge: dict[str, _Charge],
    work_of: dict[str, _Work],
    charges: dict[str, _Charge],
    works: dict[str, _Work],
) -> None:
    """Split each deployment's charge over the groups that used it, by busy seconds (by
    request count where none took measurable time)."""

    def group_of(u: Usage) -> str:
        if u.shadow:
            return SHADOW
        if by == "key":
            return u.key_id
        return u.team or NO_TEAM

    weights: dict[str, dict[str, _Work]] = defaultdict(lambda: defaultdict(_Work))
    for u in usage:
        g = group_of(u)
        weights[u.deployment][g].add(u)
        works[g].add(u)
    for dep, c in dep_charge.items():
        users = weights.get(dep)
        total = work_of[dep]
        if not users:  # nobody used it: all idle already
            charges[UNALLOCATED].add(c)
            continue
        use_time = total.busy_s > 0
        for g, w in users.items():
            share = w.busy_s / total.busy_s if use_time else w.requests / total.requests
            charges[g].add(c, share)
