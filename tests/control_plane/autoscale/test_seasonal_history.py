"""The daily and weekly cycles seeded from the demand the database keeps (`usage_records`),
so a fresh control plane or a new leader warms up before the peak instead of learning the
cycle again for two days: the seed itself (slot means, periods, a memory that knows more
keeps its own), the SQL per 15-minute slot on SQLite and PostgreSQL, and the loop seeding a
deployment it first builds a memory for. History is bursty: heavy-tailed per-slot swings
and burst slots on top of the day."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest
from sqlalchemy import insert, update

from control_plane.autoscale import ScalerState, make_policy
from control_plane.autoscale.seasonal import BIN_S, DAY_S, HISTORY_S, from_history
from control_plane.autoscale.slo import SloMemory
from control_plane.db import models as m
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.loops.autoscale_history import read_history, slot_totals
from tests.control_plane.autoscale.test_resume import _database, _loop, _tick
from tests.control_plane.autoscale.test_slo import Work, at, run

T0 = 1_800_000_000.0 - 1_800_000_000.0 % DAY_S  # a midnight (UTC): the slots are by time of day
SLOT = int(BIN_S)
NIGHT, DAY = Work(0.5, 1500, 200), Work(8.0, 1500, 200)


def busy(t: float) -> bool:
    return 8 * 3600 <= t % DAY_S < 18 * 3600


def bursty_history(days: float, seed: int) -> dict[int, tuple[float, float, float]]:
    """Work done per absolute slot: the day's rate times a heavy-tailed swing (Pareto, some
    slots several times the mean), and a burst slot of long prompts now and then."""
    rng = random.Random(seed)
    out = {}
    first = int(T0 // BIN_S)
    for s in range(first, first + int(days * DAY_S / BIN_S)):
        w = DAY if busy(s * BIN_S) else NIGHT
        swing = min(rng.paretovariate(2.5), 6.0) / 1.6  # mean about 1
        prompt = w.prompt * (4.0 if rng.random() < 0.05 else 1.0)  # a burst of long prompts
        n = w.rps * swing * BIN_S
        out[s] = (n, n * prompt, n * w.output)
    return out


def seeded_state(days: float, seed: int, at: float) -> ScalerState:
    totals = bursty_history(days, seed)
    state = ScalerState()
    make_policy("ours").seed_cycles(state, from_history(totals, min(totals), max(totals) + 1), at)
    return state


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_stored_daily_cycle_warms_up_ahead_of_the_peak_right_after_a_fresh_start(seed: int) -> None:
    # Eight days of history; the control plane starts at 07:30 on the ninth, at night's load.
    start = T0 + 8 * DAY_S + 7.5 * 3600
    work = [(start + t, DAY if busy(start + t) else NIGHT) for t in range(0, 3600, 30)]
    seeded = run("ours", work, state=seeded_state(8, seed, start))
    cold = run("ours", work)
    day_need = at(cold, start + 3000)  # at 08:20, once the day's load is there
    before = start + 1800 - 60  # 07:59, one minute before the peak
    assert at(cold, before) < day_need - 1  # no history: the peak is met cold
    assert at(seeded, before) >= day_need - 1  # warm already
    d = next(d for t, _, d in seeded if t >= before)
    assert "daily cycle" in d.reason and d.predicted["seasonal_cycle"] == "daily"
    night = run("ours", [(T0 + 9 * DAY_S + 3 * 3600 + t, NIGHT) for t in range(0, 600, 30)],
                state=seeded_state(8, seed, T0 + 9 * DAY_S + 3 * 3600))  # fmt: skip
    assert night[-1][1] < day_need  # the night is not held


def test_the_seed_counts_periods_per_slot_and_a_short_history_says_nothing_yet() -> None:
    totals = {
        s: (900.0, 900.0 * 1000, 0.0) for s in range(int(T0 // BIN_S), int((T0 + 1.5 * DAY_S) // BIN_S))
    }
    history = from_history(totals, min(totals), max(totals) + 1)
    assert history.daily.seen(T0) == 1.0  # half the slots seen twice, the other half once
    assert history.daily.slots[0].load.requests_per_s == pytest.approx(1.0)
    assert history.daily.forecast(T0 + 2 * DAY_S) is None  # one period: no cycle yet
    assert history.weekly.seen(T0) == 0.0  # not every slot of the week seen


def test_a_memory_that_has_seen_more_keeps_its_own_cycle() -> None:
    at_ = T0 + 8 * DAY_S
    state = seeded_state(8, 1, at_)
    mem = state.memory["ours"]
    assert isinstance(mem, SloMemory) and mem.seasons.daily.seen(at_) == 8
    shorter = from_history(bursty_history(3, 2), int(T0 // BIN_S), int((T0 + 3 * DAY_S) // BIN_S))
    before = {i: s.load for i, s in mem.seasons.daily.slots.items()}
    assert make_policy("ours").seed_cycles(state, shorter, at_) == []
    assert {i: s.load for i, s in mem.seasons.daily.slots.items()} == before


# --------------------------------------------------------------------- the database

NAME = "chat"


def test_seeding_a_resumed_memory_does_not_count_its_last_day_twice() -> None:
    """A resumed memory still holds the unfolded sum of the last day it saw in each slot;
    the history already includes that day, so only the slot now open keeps its sum."""
    from control_plane.autoscale.capacity import Load
    from control_plane.autoscale.seasonal import Seasons

    start = T0 + 7 * DAY_S
    mine = Seasons()
    for t in range(0, int(2 * BIN_S) + 60, 30):  # two slots and a bit of the third, today
        mine.observe(start + t, Load(1.0, 100.0, 10.0))
    history = Seasons()
    for day in range(7):
        for index in range(int(DAY_S // BIN_S)):
            history.daily.seed(index, Load(2.0, 200.0, 20.0), float(day + 1))
    now = start + 2 * BIN_S + 60
    assert mine.seed_from(history, now) == ["daily"]
    pending = {i: slot.acc_s for i, slot in mine.daily.slots.items() if slot.acc_s > 0}
    assert list(pending) == [mine.daily._index(now)]  # the slot the history stops short of
    # the closed slots are the history's mean, not blended again with today's
    mine.observe(start + DAY_S + 30, Load(2.0, 200.0, 20.0))  # tomorrow folds what was pending
    first = mine.daily.slots[mine.daily._index(start)]
    assert first.load.requests_per_s == 2.0


LOW_NIGHT, LOW_DAY = 0.005, 0.1  # requests/s: few rows, the same shape


def usage_rows(deployment: str, start: float, end: float, seed: int) -> list[dict]:
    """One row per request: Poisson-ish counts per slot, heavy-tailed prompt lengths."""
    rng = random.Random(seed)
    rows = []
    for s in range(int(start // BIN_S), int(end // BIN_S)):
        rate = LOW_DAY if busy(s * BIN_S) else LOW_NIGHT
        for _ in range(int(rng.expovariate(1.0) * rate * BIN_S + 0.5)):
            at_ = s * BIN_S + rng.random() * (BIN_S - 1e-3)
            rows.append({
                "at": datetime.fromtimestamp(at_, timezone.utc), "cluster": "c1", "key_id": "k",
                "deployment": deployment, "prompt_tokens": int(min(rng.paretovariate(1.5), 30) * 500),
                "completion_tokens": 50, "status": 200, "shadow": False,
            })  # fmt: skip
    return rows


def expected_totals(rows: list[dict], since: float, until: float) -> dict[int, tuple[float, float, float]]:
    out: dict[int, tuple[float, float, float]] = {}
    for r in rows:
        t = r["at"].timestamp()
        if since <= t < until and r["deployment"] == NAME and r["status"] < 400 and not r.get("shadow"):
            n, p, o = out.get(int(t // BIN_S), (0.0, 0.0, 0.0))
            out[int(t // BIN_S)] = (n + 1, p + r["prompt_tokens"], o + r["completion_tokens"])
    return out


def test_slot_totals_are_summed_in_sql_per_15_minute_slot(db_url) -> None:
    upgrade_to_head(db_url)
    sessions = make_sessions(db_url)
    try:
        now = T0 + 10 * DAY_S + 7 * 3600 + 123.0
        rows = usage_rows(NAME, T0, now, seed=5)
        edge = datetime.fromtimestamp(T0 + 9 * DAY_S + SLOT - 0.001, timezone.utc)  # the last ms of a slot
        rows += [{**rows[-1], "at": edge}, {**rows[-1], "deployment": "other"}, {**rows[-1], "shadow": True},
                 {**rows[-1], "status": 429, "prompt_tokens": 0}]  # fmt: skip
        with sessions() as s:
            s.execute(insert(m.UsageRecord), rows)
            s.commit()
            got = slot_totals(s, NAME, now - HISTORY_S, now)
        want = expected_totals(rows, (now - HISTORY_S) // BIN_S * BIN_S + BIN_S, now // BIN_S * BIN_S)
        assert got == want and min(got) >= (now - HISTORY_S) // BIN_S and max(got) < now // BIN_S
        with sessions() as s:
            seasons = read_history(s, NAME, now)
            assert seasons is not None and seasons.daily.seen(now) >= 7
            assert read_history(s, "nothing-recorded", now) is None
    finally:
        sessions.kw["bind"].dispose()


def test_a_fresh_leader_seeds_the_cycle_from_the_stored_demand(tmp_path) -> None:
    now = T0 + 3 * DAY_S + 7.5 * 3600  # 07:30 on the fourth day: three days recorded
    rows = usage_rows(NAME, T0, now, seed=7)
    sessions = _database(tmp_path, "history.db")
    with sessions() as s:
        s.execute(insert(m.UsageRecord), rows)
        # created before the recorded days, whatever today's date (history starts at creation)
        s.execute(update(m.Deployment).values(created_at=datetime.fromtimestamp(T0 - DAY_S, timezone.utc)))
        s.commit()
    loop = _loop(tmp_path, sessions)
    quiet = Work(LOW_NIGHT, 1500, 50)
    for t in [*range(0, 1740, 120), 1740]:  # from 07:30 to 07:59 at night's load, from a fresh start
        _, reason = _tick(loop, now + t, quiet)
    assert loop.resumed == 0 and loop.seeded == 1
    mem = loop.states[NAME].memory["ours"]
    assert isinstance(mem, SloMemory) and mem.seasons.daily.seen(now) >= 2
    decided = loop.last[NAME]
    assert "daily cycle" in reason and decided.predicted["seasonal_cycle"] == "daily"
    assert decided.predicted["requests_per_s"] >= LOW_DAY / 2  # sized for the day ahead
    # Control: the same start with nothing recorded learns nothing.
    empty = _loop(tmp_path, _database(tmp_path, "empty.db"))
    for t in [*range(0, 1740, 120), 1740]:
        _, reason = _tick(empty, now + t, quiet)
    assert empty.seeded == 0 and "cycle" not in reason
    sessions.kw["bind"].dispose()
