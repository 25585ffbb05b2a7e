"""A deployment's burst memory: the peaks of its work in short windows, remembered over a
long, decaying memory, and the gaps between them. Pure and dependency-free: the SLO policy
keeps one in its `ScalerState` memory and asks it, every decision, what burst to hold
capacity for and for how long.

- work is summed into `WINDOW_S` windows (requests, prompt and output tokens); a window is
  part of a burst when the replicas its load needs are at least `BURST_RATIO` x those of
  the slow baseline (an exponential mean over `BASELINE_S`) and at least one more: a smooth
  trace, whose windows wander around its baseline, has no bursts and the memory adds nothing;
- a burst (consecutive burst windows) is remembered with its peak window's load and need,
  its work, and the gap since the previous burst ended; its weight decays as
  exp(-age / `MEMORY_S`) and it is forgotten below `FORGET_WEIGHT`;
- `need`: the replicas to hold through a lull are the smallest fixed fleet that would have
  met the SLO on the remembered work (decay-weighted, counted in requests like the SLO),
  replayed in `SLICE_S` slices (a 10 s window averages a burst that starts inside it over
  the whole window and hides the queue it builds): each slice's prefill work
  (replica-seconds) queues when it exceeds the fleet, and its requests wait behind that
  backlog and for each other inside the slice (M/G/n as in the capacity model, the queue
  no longer than the spread of the slice's work: arrivals bunch even where the work fits
  the fleet on average); a request misses when its wait and its own prefill (spread
  exponentially around the slice's mean) exceed the TTFT target. The fleet may miss at
  most the miss budget of the requests whose own prefill fits the target (the rest no
  fleet serves in time). A short burst is absorbed by a queue that drains before its
  requests miss: its peak window's steady-state need overstates it;
- `hold_s`: how long after a burst to keep that capacity through a lull. Holding a replica
  for one cold start costs no more GPU time than starting it again (a starting replica is
  paid for), so never less than the cold start; beyond it, as long as the observed gaps
  say the next burst is still likely to come: the gap that all but the miss budget of gaps
  fall within (a Pareto tail fitted to the remembered gaps, at the lower bound of its
  index; with fewer than four gaps, the memory), capped by the memory (a lull longer than the memory has
  outlived what it remembers).

The memory lives in the policy's `ScalerState`; the autoscale loop stores it with the rest
of that state every few seconds (`control_plane.autoscale.snapshot`), so a new leader or a
restarted control plane resumes with it."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from control_plane.autoscale.capacity import PROMPT_CV2, Load, wait_tail

WINDOW_S = 10.0  # the short window a burst is measured in
SLICE_S = 2.0  # the queue model's resolution (at most one slice per decision)
BASELINE_S = 300.0  # time constant of the baseline a burst stands out from
MEMORY_S = 1800.0  # time constant of the burst memory's decay
FORGET_WEIGHT = 0.05  # a burst whose decayed weight fell below this is forgotten
BURST_RATIO = 2.0  # a window needs this many times the baseline's replicas to be a burst
MAX_BURSTS = 256
SERVICE_M2 = 1.0 + PROMPT_CV2  # own prefill times spread exponentially around a slice's mean
MIN_GAPS = 4.0  # decay-weighted gaps before their tail is fitted (Hill's lower bound needs > 4)


@dataclass(frozen=True)
class Burst:
    start: float
    end: float
    peak: Load  # the load of its busiest window
    need: int  # replicas the busiest window needed
    work: float  # requests it brought
    gap_s: float | None  # since the previous burst ended (None: the first remembered)


@dataclass(frozen=True)
class BurstView:
    """What the memory says now: the burst to hold for (None: none remembered), for how
    long after the last one, and whether the lull has outlasted that."""

    peak: Load | None
    need: int
    hold_s: float
    since_s: float  # since the last burst ended (inf: none)
    bursts: int
    gap_s: float | None  # the gap quantile behind hold_s (None: no gap seen yet)

    @property
    def holding(self) -> bool:
        return self.peak is not None and self.since_s <= self.hold_s


@dataclass
class BurstMemory:
    window_start: float | None = None
    requests: float = 0.0  # work summed over the open window
    prompt: float = 0.0
    output: float = 0.0
    last_at: float | None = None
    baseline: Load | None = None
    bursts: deque[Burst] = field(default_factory=deque)
    open: Burst | None = None  # the burst in progress
    last_end: float | None = None

    windows: deque[tuple[float, int, float, float]] = field(
        default_factory=deque
    )  # the queue model's slices: end, need, busy, requests
    slice_start: float | None = None
    slice_requests: float = 0.0  # work summed over the open slice
    slice_prompt: float = 0.0
    slice_output: float = 0.0
    slice_need: int = 0  # the busiest slice's need in the open window
    miss_budget: float = 0.01
    held: int = 0  # the fleet the remembered slices need (recomputed as a window closes)
    ttft_s: float = 2.0

    def update(
        self,
        t: float,
        now: Load,
        need: Callable[[Load], tuple[int, float]],
        ttft_s: float = 2.0,
        idle: bool = False,
    ) -> None:
        """Add this tick's rates (over the time since the last tick) and close the windows
        that ended; `need` maps a load to the replicas it needs (the capacity model).

        `idle` on the first tick (nothing serving, nothing arriving: a new deployment) starts
        the baseline at no load, so that its first traffic stands out as the burst it is;
        otherwise the first window seeds it (a restart amid traffic is no burst). Seeded
        from a first window that a burst began in, the baseline would be that burst, and
        bursts like it would go unseen for many baseline time constants."""
        if self.last_at is None or self.window_start is None:
            self.last_at, self.window_start, self.slice_start = t, t, t
            if idle and self.baseline is None:
                self.baseline = Load()
            return
        dt = max(0.0, t - self.last_at)
        self.last_at, self.ttft_s = t, ttft_s
        self.requests += now.requests_per_s * dt
        self.prompt += now.prompt_tokens_per_s * dt
        self.output += now.output_tokens_per_s * dt
        self.slice_requests += now.requests_per_s * dt
        self.slice_prompt += now.prompt_tokens_per_s * dt
        self.slice_output += now.output_tokens_per_s * dt
        start = self.slice_start if self.slice_start is not None else self.window_start
        if t - start >= SLICE_S:
            self._slice(t, t - start, need)
        while t - self.window_start >= WINDOW_S:
            span = t - self.window_start
            self._close(t, Load(self.requests / span, self.prompt / span, self.output / span), need)
            self.window_start = t
            self.requests = self.prompt = self.output = 0.0

    def _slice(self, t: float, span: float, need: Callable[[Load], tuple[int, float]]) -> None:
        """Close the queue model's slice: a 10 s window averages a burst that starts inside
        it over the whole window and hides the queue its bunched arrivals build."""
        load = Load(self.slice_requests / span, self.slice_prompt / span, self.slice_output / span)
        n, busy = need(load) if load.requests_per_s > 0 else (0, 0.0)
        self.windows.append((t, n, busy, self.slice_requests))
        self.slice_need = max(self.slice_need, n)
        while self.windows and math.exp(-(t - self.windows[0][0]) / MEMORY_S) < FORGET_WEIGHT:
            self.windows.popleft()
        self.slice_start = t
        self.slice_requests = self.slice_prompt = self.slice_output = 0.0

    def _close(self, t: float, load: Load, need: Callable[[Load], tuple[int, float]]) -> None:
        base = self.baseline or load
        a = 1 - math.exp(-WINDOW_S / BASELINE_S)
        n = need(load)[0] if load.requests_per_s > 0 else 0
        n_base = need(base)[0] if base.requests_per_s > 0 else 0
        # Told from the baseline by the window's load; held to at most its busiest slice's
        # need, which a burst shorter than the window exceeds the window's own.
        top, self.slice_need = max(n, self.slice_need), 0
        bursting = n >= max(BURST_RATIO * n_base, n_base + 1) and n >= 1
        if bursting:
            work = load.requests_per_s * WINDOW_S
            b = self.open
            if b is None:
                gap = t - WINDOW_S - self.last_end if self.last_end is not None else None
                self.open = Burst(t - WINDOW_S, t, load, top, work, gap)
            else:
                peak, top = (load, top) if top > b.need else (b.peak, b.need)
                self.open = Burst(b.start, t, peak, top, b.work + work, b.gap_s)
        elif self.open is not None:
            self._remember(self.open)
            self.open = None
        # The baseline follows the load slowly: a burst of seconds barely lifts it, a new
        # level (the morning) becomes the baseline within minutes and is no burst.
        self.baseline = Load(
            (1 - a) * base.requests_per_s + a * load.requests_per_s,
            (1 - a) * base.prompt_tokens_per_s + a * load.prompt_tokens_per_s,
            (1 - a) * base.output_tokens_per_s + a * load.output_tokens_per_s,
        )
        self.held = self._fleet(t)

    def _fleet(self, t: float) -> int:
        """The smallest fixed fleet whose decay-weighted missed requests over the remembered
        slices stay within the miss budget of those that can meet the target at all. A
        slice's span is the time since the one before (a stored 10 s window, a long tick)."""
        rows = []
        last = None
        for end, n, busy, r in self.windows:
            span = end - last if last is not None else SLICE_S
            last = end
            own = busy * span / r if r > 0 else 0.0  # a mean request's own prefill
            rows.append((math.exp(-(t - end) / MEMORY_S) * r, n, busy, own, span))
        slack = self.ttft_s
        total = sum(w * _attainable(own, slack) for w, n, _, own, _ in rows if n > 0)
        if total <= 0:
            return 0

        def missed(fleet: int) -> float:
            backlog, out = 0.0, 0.0
            for w, n, busy, own, span in rows:
                if n <= 0:
                    backlog = max(0.0, backlog - fleet * span)
                    continue
                if fleet <= 0:
                    out += w * _attainable(own, slack)
                    continue
                before = backlog / fleet
                backlog = max(0.0, backlog + (busy - fleet) * span)
                after = backlog / fleet
                # Inside the slice, arrivals queue for each other even where its work fits
                # the fleet on average (M/G/n). Within one slice that queue cannot outgrow
                # the spread of the work the slice brings (a random walk over its span:
                # sqrt(arrivals x E[S^2]) over the fleet), which also bounds the wait as the
                # slice nears the fleet's capacity and beyond, where every arrival waits.
                spread = math.sqrt(own * busy * span * SERVICE_M2) / fleet
                c, theta = wait_tail(fleet, busy, own, SERVICE_M2) if busy < fleet else (1.0, spread)
                theta = min(theta, spread)
                # The backlog's wait over the slice, by Simpson's rule.
                waits = ((before, 1.0), ((before + after) / 2, 4.0), (after, 1.0))
                out += w * sum(k * _missed_share(x, own, slack, c, theta) for x, k in waits) / 6
            return out

        lo, hi = 0, max(n for _, n, _, _, _ in rows)
        while lo < hi:
            mid = (lo + hi) // 2
            if missed(mid) <= self.miss_budget * total:
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _remember(self, b: Burst) -> None:
        self.bursts.append(b)
        self.last_end = b.end
        while len(self.bursts) > MAX_BURSTS:
            self.bursts.popleft()

    def view(self, t: float, cold_start_s: float, miss_budget: float) -> BurstView:
        """The burst to hold for at `t`, and for how long after the last one."""
        while self.bursts and _weight(t, self.bursts[0]) < FORGET_WEIGHT:
            self.bursts.popleft()
        known = list(self.bursts) + ([self.open] if self.open is not None else [])
        self.miss_budget = miss_budget
        if not known:
            return BurstView(None, 0, cold_start_s, math.inf, 0, None)
        chosen = max(known, key=lambda b: (b.need, b.end))
        # Every remembered burst (`_close` already told it from the baseline): a count tied to
        # the held fleet would let a larger held fleet discount bursts and end the hold early.
        big = known
        gaps = [(b.start - a.end, _weight(t, b)) for a, b in itertools.pairwise(big)]
        gap = _tail_quantile(gaps, self.miss_budget) if gaps else None
        hold = min(max(cold_start_s, gap or 0.0), MEMORY_S)
        if self.open is not None and big and big[-1] is self.open:
            since = 0.0
        else:
            since = t - big[-1].end if big else math.inf
        return BurstView(chosen.peak, min(self.held, chosen.need), hold, since, len(known), gap)


def _weight(t: float, b: Burst) -> float:
    return math.exp(-max(0.0, t - b.end) / MEMORY_S)


def _tail_quantile(values: list[tuple[float, float]], budget: float) -> float:
    """The gap that all but `budget` of gaps fall within, from a Pareto tail fitted above
    the shortest remembered gap (Hill's estimator, decay-weighted, at its lower bound: a
    heavier tail): the gaps between bursts of real traffic are heavy-tailed, and the next one
    is longer than all the remembered ones one time in (count + 1). Too few gaps to bound
    the tail: as long as the memory. Never below the longest seen; equal gaps (a clock) give
    that gap."""
    total = sum(w for _, w in values)
    if total < MIN_GAPS:
        return math.inf
    low = max(min(v for v, _ in values), 1.0)
    logs = sum(w * math.log(max(v, low) / low) for v, w in values)
    longest = max(v for v, _ in values)
    if logs <= 1e-9:
        return longest
    # Hill's estimate has a relative error of about 1 / sqrt(count).
    alpha = total / logs * (1 - 2 / math.sqrt(total))
    if alpha <= 1e-3:
        return math.inf
    return max(longest, low * math.exp(min(50.0, -math.log(max(budget, 1e-6)) / alpha)))


def _attainable(own_s: float, slack: float) -> float:
    """The share of a slice's requests whose own prefill fits the target at all (own
    times exponential around the mean `own_s`)."""
    return 1.0 - math.exp(-slack / own_s) if own_s > 0 else 1.0


def _missed_share(wait: float, own_s: float, slack: float, c: float, theta: float) -> float:
    """The share of a slice's requests that could meet the target but miss it: own
    prefill times exponential around `own_s`, behind a backlog of `wait` seconds, then
    waiting again with P(> x) = c exp(-x / theta) (the slice's own queueing)."""
    room = slack - wait
    if room <= 0:
        return _attainable(own_s, slack)
    if own_s <= 0:
        return c * math.exp(-room / theta) if c > 0 and theta > 0 else 0.0
    behind = math.exp(-room / own_s) - math.exp(-slack / own_s)  # own + wait > slack
    if c <= 0 or theta <= 0:
        return behind
    # Those that fit behind the backlog: P(own <= room, own + queue wait > room).
    k = own_s / theta - 1.0
    if abs(k) < 1e-9:
        queued = c * room / own_s * math.exp(-room / own_s)
    else:
        queued = c * (math.exp(-room / own_s) - math.exp(-room / theta)) / k
    return behind + queued
