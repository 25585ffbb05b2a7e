"""Daily and weekly cycles of a deployment's work, so replicas are warm before the morning
peak rather than one cold start after it. Dependency-free on purpose: per cycle, the mean
load in each `BIN_S` slot of the period (an exponential mean over the periods seen), read
one cold start ahead. A cycle speaks only once it has seen `MIN_PERIODS` periods and its
slots differ by at least `MIN_SWING` (a flat history is no cycle); the daily cycle is read
first, the weekly one where it has seen enough weeks (it then knows weekdays from weekends).

The history comes in two ways: the policy's own observations (`observe`), and a seed of
past slot means from the work the control plane recorded (`from_history`: the
`usage_records` table of the last `HISTORY_S`, summed per slot in SQL by
`control_plane.loops.autoscale_history`), taken by a memory that has seen fewer periods
(`Seasons.seed_from`), so a fresh control plane or a new leader knows the day's cycle at once."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from control_plane.autoscale.capacity import Load

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
BIN_S = 900.0  # 15-minute slots
MIN_PERIODS = 2.0  # periods seen before a cycle speaks
MIN_SWING = 1.5  # busiest slot / quietest slot for a cycle to count
PERIOD_WEIGHT = 0.5  # weight of the latest period in a slot's mean
# Recorded work read into the cycles at start-up: the daily cycle's eight periods, bounded
# (a weekly cycle needs two weeks: it learns live, or from a memory stored by a leader).
HISTORY_S = 8 * DAY_S


@dataclass
class Slot:
    load: Load = field(default_factory=Load)
    periods: float = 0.0  # periods that added to this slot (fractions: partial coverage)
    seen_in: int = -1  # the period index last added to
    acc: Load = field(default_factory=Load)  # this period's sum of rate x seconds
    acc_s: float = 0.0


@dataclass
class Cycle:
    period_s: float
    slots: dict[int, Slot] = field(default_factory=dict)
    first_at: float | None = None
    last_at: float | None = None

    def observe(self, t: float, load: Load) -> None:
        if self.first_at is None:
            self.first_at = t
        dt = 0.0 if self.last_at is None else max(0.0, min(t - self.last_at, BIN_S))
        self.last_at = t
        slot = self.slots.setdefault(self._index(t), Slot())
        period = int(t // self.period_s)
        if slot.seen_in != period:
            _fold(slot)
            slot.seen_in = period
        slot.acc = _add(slot.acc, load, dt)
        slot.acc_s += dt

    def seed(self, index: int, load: Load, periods: float = 1.0) -> None:
        """A slot's mean load from the history (`index`: the slot in the period)."""
        slot = self.slots.setdefault(index % self._bins(), Slot())
        slot.load, slot.periods = load, max(slot.periods, periods)

    def drop_pending_before(self, t: float) -> None:
        """Forget what the slots gathered of periods the history already holds (all but the
        slot `t` is in, in `t`'s period): folded in on top of the seeded means, the last
        period seen before a takeover would count twice."""
        current, period = self._index(t), int(t // self.period_s)
        for index, slot in self.slots.items():
            if index != current or slot.seen_in != period:
                slot.acc, slot.acc_s = Load(), 0.0

    def seen(self, t: float) -> float:
        """Periods of history: observed, or the slots' seeded counts (the least)."""
        observed = (t - self.first_at) / self.period_s if self.first_at is not None else 0.0
        seeded = min((s.periods for s in self.slots.values()), default=0.0)
        return max(observed, seeded if len(self.slots) == self._bins() else 0.0)

    def forecast(self, t: float) -> Load | None:
        """The slot mean at `t`, when the cycle has seen enough and swings enough."""
        if self.seen(t) < MIN_PERIODS:
            return None
        done = [s.load for s in self.slots.values() if s.periods > 0]
        if len(done) < 2:
            return None
        busy = max(x.prompt_tokens_per_s + x.output_tokens_per_s for x in done)
        quiet = min(x.prompt_tokens_per_s + x.output_tokens_per_s for x in done)
        if busy <= 0 or busy < MIN_SWING * max(quiet, 1e-9):
            return None
        slot = self.slots.get(self._index(t))
        return slot.load if slot is not None and slot.periods > 0 else None

    def _index(self, t: float) -> int:
        return int((t % self.period_s) // BIN_S)

    def _bins(self) -> int:
        return math.ceil(self.period_s / BIN_S)


def _add(a: Load, b: Load, dt: float) -> Load:
    return Load(
        a.requests_per_s + b.requests_per_s * dt,
        a.prompt_tokens_per_s + b.prompt_tokens_per_s * dt,
        a.output_tokens_per_s + b.output_tokens_per_s * dt,
    )


def _fold(slot: Slot) -> None:
    """The period that last added to the slot ends: its mean joins the slot's."""
    if slot.acc_s <= 0:
        return
    mean = slot.acc.scaled(1 / slot.acc_s)
    w = 1.0 if slot.periods <= 0 else PERIOD_WEIGHT
    slot.load = Load(
        (1 - w) * slot.load.requests_per_s + w * mean.requests_per_s,
        (1 - w) * slot.load.prompt_tokens_per_s + w * mean.prompt_tokens_per_s,
        (1 - w) * slot.load.output_tokens_per_s + w * mean.output_tokens_per_s,
    )
    slot.periods += min(1.0, slot.acc_s / BIN_S)
    slot.acc, slot.acc_s = Load(), 0.0


@dataclass
class Seasons:
    """The daily and weekly cycles of one deployment."""

    daily: Cycle = field(default_factory=lambda: Cycle(DAY_S))
    weekly: Cycle = field(default_factory=lambda: Cycle(WEEK_S))

    def seed_from(self, history: Seasons, at: float) -> list[str]:
        """Each cycle of `history` that has seen more periods than this one's lends it its
        slot means (this period's own observations go on adding to them); the cycles taken."""
        taken = []
        for name in ("daily", "weekly"):
            mine, theirs = getattr(self, name), getattr(history, name)
            if theirs.seen(at) > mine.seen(at):
                for index, slot in theirs.slots.items():
                    mine.seed(index, slot.load, slot.periods)
                mine.drop_pending_before(at)
                taken.append(name)
        return taken

    def observe(self, t: float, load: Load) -> None:
        self.daily.observe(t, load)
        self.weekly.observe(t, load)

    def forecast(self, t: float) -> tuple[Load | None, str]:
        """The expected load at `t` and the cycle it comes from ("" : none speaks)."""
        weekly = self.weekly.forecast(t)
        if weekly is not None:
            return weekly, "weekly"
        daily = self.daily.forecast(t)
        return (daily, "daily") if daily is not None else (None, "")


def from_history(totals: Mapping[int, tuple[float, float, float]], first: int, end: int) -> Seasons:
    """Cycles from recorded work: `totals` maps a slot since the epoch (`epoch // BIN_S`) to
    the requests, prompt and output tokens done in it, over slots `first` .. `end` - 1 (a slot
    missing from it did no work). Each slot of a period gets its mean over the periods that
    covered it, and that count as its periods."""
    seasons = Seasons()
    for cycle in (seasons.daily, seasons.weekly):
        bins = cycle._bins()
        sums: dict[int, list[float]] = {}
        for s in range(first, end):
            acc = sums.setdefault(s % bins, [0.0, 0.0, 0.0, 0.0])
            n, prompt, output = totals.get(s, (0.0, 0.0, 0.0))
            acc[0] += n
            acc[1] += prompt
            acc[2] += output
            acc[3] += 1
        for index, (n, prompt, output, periods) in sums.items():
            per_s = 1.0 / (periods * BIN_S)
            cycle.seed(index, Load(n * per_s, prompt * per_s, output * per_s), periods)
    return seasons
