"""The election policy: table tests of single observations, and a simulation of several
candidates on one compare-and-set store with pauses, slow writes and drifting clocks."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.ha.election import Action, Candidate, LeaseRecord, max_rate_drift

LEASE, DEADLINE = 15.0, 10.0


def rec(holder, epoch=1, version=1, lease_s=LEASE) -> LeaseRecord:
    return LeaseRecord(holder=holder, epoch=epoch, version=version, lease_s=lease_s)


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([(None, 0.0)], Action.acquire),  # fresh database
        ([(rec(None), 0.0)], Action.acquire),  # released on a clean shutdown: at once
        ([(rec("b"), 0.0)], Action.follow),
        ([(rec("b"), 0.0), (rec("b"), 14.9)], Action.follow),
        ([(rec("b"), 0.0), (rec("b"), 15.0)], Action.acquire),  # unchanged for lease_s
        ([(rec("b"), 0.0), (rec("b", version=2), 10.0), (rec("b", version=2), 24.9)], Action.follow),
        ([(rec("b"), 0.0), (rec("b", version=2), 10.0), (rec("b", version=2), 25.0)], Action.acquire),
        (
            [(rec("b", lease_s=30.0), 0.0), (rec("b", lease_s=30.0), 20.0)],
            Action.follow,
        ),  # the holder's lease
        ([(rec("a"), 0.0)], Action.acquire),  # ours, but not from a term we hold: a new epoch
    ],
)
def test_observe(steps, expected):
    c = Candidate("a", LEASE, DEADLINE)
    decision = None
    for record, now in steps:
        decision = c.observe(record, now)
    assert decision is not None and decision.action == expected


def test_leader_renews_and_must_stop_from_the_start_of_its_last_good_renew():
    c = Candidate("a", LEASE, DEADLINE)
    c.acquired(rec("a", epoch=3, version=7), started=100.0)
    assert c.observe(rec("a", epoch=3, version=7), 101.0).action == Action.renew
    c.renewed(rec("a", epoch=3, version=8), started=104.0)  # the call answered at 109: still from 104
    assert not c.must_stop(113.9)
    assert c.must_stop(114.0)
    assert c.believes_leading(113.9) and not c.believes_leading(114.0)


def test_a_refused_renew_ends_leading_and_a_late_renew_does_not_revive_it():
    c = Candidate("a", LEASE, DEADLINE)
    c.acquired(rec("a", epoch=3, version=7), 0.0)
    c.lost()
    c.renewed(rec("a", epoch=3, version=8), 1.0)
    assert not c.leading and c.epoch == 0
    assert c.observe(rec("a", epoch=3, version=8), 2.0).action == Action.acquire  # a new epoch


def test_an_acquire_answered_after_its_own_deadline_does_not_lead():
    """Its successor may have taken over meanwhile: the next observation takes a new epoch."""
    c = Candidate("a", LEASE, DEADLINE)
    assert not c.acquired(rec("a", epoch=1, version=1), 0.0, DEADLINE + 3.0)
    assert not c.leading and c.epoch == 0 and not c.believes_leading(DEADLINE + 3.0)
    assert c.observe(rec("a", epoch=1, version=1), DEADLINE + 3.0).action == Action.acquire
    assert c.acquired(rec("a", epoch=2, version=2), 20.0, 20.5) and c.epoch == 2


def test_settings_bound():
    assert max_rate_drift(15, 10) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        Candidate("a", 10, 10)


# --------------------------------------------------------------------- simulation


@dataclass
class Store:
    """A compare-and-set lease and a fenced data register, applied atomically."""

    record: LeaseRecord | None = None
    data_epochs: list[int] = field(default_factory=list)  # epochs of accepted data writes
    refused: int = 0

    def acquire(self, me: str, seen: LeaseRecord | None, lease_s: float) -> LeaseRecord | None:
        if self.record != seen:
            return None
        epoch = (self.record.epoch if self.record else 0) + 1
        version = (self.record.version if self.record else 0) + 1
        self.record = LeaseRecord(me, epoch, version, lease_s)
        return self.record

    def renew(self, me: str, epoch: int) -> LeaseRecord | None:
        r = self.record
        if r is None or r.holder != me or r.epoch != epoch:
            return None
        self.record = LeaseRecord(me, epoch, r.version + 1, r.lease_s)
        return self.record

    def write(self, epoch: int) -> None:
        if self.record is not None and self.record.epoch == epoch:
            self.data_epochs.append(epoch)
        else:
            self.refused += 1


@dataclass
class Node:
    cand: Candidate
    rate: float
    offset: float
    busy: bool = False
    since: float | None = None  # real time its current belief began
    intervals: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, epoch)

    def local(self, t: float) -> float:
        return self.offset + self.rate * t

    def real(self, local: float) -> float:
        return (local - self.offset) / self.rate

    def check(self, t: float) -> None:
        """The elector's deadline check: stop believing once the renew deadline passed."""
        if self.cand.leading and self.cand.must_stop(self.local(t)):
            self.end(self.real(self.cand.deadline()))

    def end(self, t: float) -> None:
        if self.since is not None:
            self.intervals.append((self.since, t, self.cand.epoch))
            self.since = None
        self.cand.lost()


op = st.tuples(
    st.integers(0, 2),  # which candidate
    st.floats(0.0, 6.0),  # real seconds since the previous step
    st.floats(0.0, 20.0) | st.just(0.01),  # start -> applied (a pause, a slow database)
    st.floats(0.0, 20.0) | st.just(0.01),  # applied -> answered
    st.sampled_from(["elect", "elect", "elect", "write", "crash"]),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(op, min_size=1, max_size=80),
    rates=st.lists(st.sampled_from([-1.0, 1.0]) | st.floats(-1.0, 1.0), min_size=3, max_size=3),
    offsets=st.lists(st.floats(-1e6, 1e6), min_size=3, max_size=3),
)
def test_never_two_leaders_at_once_and_old_epochs_never_write(ops, rates, offsets):
    spans, store = simulate(ops, rates, offsets, max_rate_drift(LEASE, DEADLINE) * 0.99)
    for (_s1, e1, ep1), (s2, _e2, ep2) in itertools.pairwise(spans):
        assert e1 <= s2, f"epoch {ep1} believed until {e1}, epoch {ep2} from {s2}"
        assert ep1 < ep2
    assert store.data_epochs == sorted(
        store.data_epochs
    )  # a paused old leader never wrote after its successor


def overlaps(spans) -> bool:
    return any(e1 > s2 for (_s1, e1, _), (s2, _e2, _) in itertools.pairwise(spans))


@pytest.mark.parametrize(("factor", "overlap"), [(0.95, False), (1.05, True)])
def test_the_drift_bound_is_tight(factor, overlap):
    """A slow-clocked leader whose renew hangs, a fast-clocked follower: just inside the
    bound the leader stops first; just outside it, both believe at once."""
    rho = max_rate_drift(LEASE, DEADLINE) * factor
    ops = [
        (0, 0.0, 0.0, 0.0, "elect"),  # c0 acquires at 0 (its belief: until 10 s of its slow clock)
        (1, 0.001, 0.0, 0.0, "elect"),  # c1 sees the record
        (0, 0.001, 1000.0, 0.0, "elect"),  # c0's renew hangs
        (1, LEASE / (1 + rho), 0.0, 0.0, "elect"),  # c1: unchanged for lease_s on its fast clock
        (1, 0.001, 0.0, 0.0, "elect"),
    ]
    spans, _ = simulate(ops, [-1.0, 1.0, 0.0], [0.0, 0.0, 0.0], rho)
    assert len(spans) >= 2
    assert overlaps(spans) == overlap


def simulate(ops, rates, offsets, rho):  # noqa: C901 (one event loop, its handlers inline)
    """Real-time discrete events: each op reads the store at once, applies its write `d1`
    later and hears the answer `d2` after that; returns every belief span (real start, end,
    epoch) sorted, and the store."""
    nodes = [Node(Candidate(f"c{i}", LEASE, DEADLINE), 1.0 + rates[i] * rho, offsets[i]) for i in range(3)]
    store = Store()
    events: list = []  # (real time, seq, callback)
    seq = 0

    def at(t: float, fn) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, fn))

    def run_until(t: float) -> None:
        while events and events[0][0] <= t:
            when, _, fn = heapq.heappop(events)
            fn(when)

    def answer(when, n, cand, result, started, action):
        n.busy = False
        if n.cand is not cand:
            return  # the process died meanwhile
        n.check(when)
        if result is None:
            if cand.leading:
                n.end(when)
        elif action == Action.acquire:
            if cand.acquired(result, started, n.local(when)):  # not when it answered after its deadline
                n.since = when
        else:
            cand.renewed(result, started)

    t = 0.0
    for who, gap, d1, d2, kind in ops:
        t += gap
        run_until(t)
        n = nodes[who]
        n.check(t)
        if n.busy:
            continue
        if kind == "crash":
            n.end(t)
            n.cand = Candidate(f"{n.cand.me}'", LEASE, DEADLINE)  # a restarted process: a new id
            continue
        if kind == "write":
            if n.cand.believes_leading(n.local(t)):
                epoch = n.cand.epoch
                at(t + d1, lambda _w, epoch=epoch: store.write(epoch))
            continue
        seen, started, cand = store.record, n.local(t), n.cand
        decision = cand.observe(seen, started)
        if decision.action == Action.follow:
            continue
        n.busy = True

        def apply(when, n=n, cand=cand, seen=seen, started=started, action=decision.action, d2=d2):
            if action == Action.acquire:
                result = store.acquire(cand.me, seen, LEASE)
            else:
                result = store.renew(cand.me, cand.epoch)
            at(when + d2, lambda w: answer(w, n, cand, result, started, action))

        at(t + d1, apply)

    run_until(float("inf"))
    end = t + 1e6
    for n in nodes:
        n.check(end)
        n.end(end)
    return sorted(span for n in nodes for span in n.intervals), store


def test_a_paused_leader_waking_after_its_successor_wrote_is_refused():
    store = Store()
    a, b = Candidate("a", LEASE, DEADLINE), Candidate("b", LEASE, DEADLINE)
    a.acquired(store.acquire("a", None, LEASE), 0.0)
    old = a.epoch
    # a pauses for 60 s; b sees the lease unchanged for lease_s and takes it
    assert b.observe(store.record, 1.0).action == Action.follow
    assert b.observe(store.record, 16.0).action == Action.acquire
    b.acquired(store.acquire("b", store.record, LEASE), 16.0)
    store.write(b.epoch)
    store.write(old)  # a wakes with a write it prepared before the pause
    assert store.data_epochs == [b.epoch] and store.refused == 1
    assert a.must_stop(60.0)
    assert store.renew("a", old) is None
