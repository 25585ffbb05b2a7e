"""Property tests of the quota policy (token buckets, QuotaBook, shares) and of the priority
waitlist, on an injected clock. The bound checked is the one docs/quotas.md states: over
any interval T a limit admits at most capacity + rate * T (net of refunds)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.gateway.priority import PriorityWaitlist
from agent.gateway.quota import QuotaBook, format_duration, limits_for, share_of
from fleet_base.api_keys import ApiKeyRecord, DeploymentLimits, Quotas
from fleet_base.token_bucket import TokenBucket

EPS = 1e-6


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def key(quotas: Quotas, shares: dict[str, float] | None = None) -> ApiKeyRecord:
    return ApiKeyRecord(key_id="k", name="k", salt="s", hash="h", quotas=quotas, shares=shares or {})


# one step: (seconds to advance, tokens asked, fraction of the reservation actually used)
steps = st.lists(
    st.tuples(
        st.floats(0, 5, allow_nan=False),
        st.integers(1, 400),
        st.floats(0, 1, allow_nan=False),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 5000), period=st.floats(0.5, 120), ops=steps)
def test_bucket_never_admits_beyond_capacity_plus_refill(capacity: int, period: float, ops) -> None:
    """Net tokens taken in any interval <= capacity + rate * interval (refunds give back)."""
    now = 0.0
    b = TokenBucket.full(capacity, period, now)
    events: list[tuple[float, float]] = []  # (time, net tokens: + taken, - refunded)
    for dt, cost, used in ops:
        now += dt
        if b.take(cost, now):
            events.append((now, cost))
            refund = cost - math.floor(cost * used)
            if refund:
                b.adjust(refund, now)
                events.append((now, -refund))
        assert b.level <= b.capacity + EPS
    rate = capacity / period
    for i, (t0, _) in enumerate(events):
        net = 0.0
        for t1, amount in events[i:]:
            net += amount
            assert net <= capacity + rate * (t1 - t0) + EPS


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 5000),
    period=st.floats(0.5, 120),
    spent=st.floats(0, 1),
    dt=st.floats(0, 300),
    want=st.floats(0, 1),
)
def test_bucket_refills_exactly(capacity: int, period: float, spent: float, dt: float, want: float) -> None:
    b = TokenBucket.full(capacity, period, 0.0)
    taken = capacity * spent
    assert b.take(taken, 0.0)
    level = capacity - taken
    assert b.available(dt) == pytest.approx(min(capacity, level + dt * capacity / period), abs=1e-6)
    # wait_s is exactly when a cost first fits, and reset_s when the bucket is full again
    b2 = TokenBucket.full(capacity, period, 0.0)
    b2.take(taken, 0.0)
    cost = capacity * want
    wait = b2.wait_s(cost, 0.0)
    assert dataclasses.replace(b2).fits(cost - 1e-6, wait)
    if wait > 1e-6:
        assert not dataclasses.replace(b2).fits(cost, wait - 1e-3 * period)
    assert b2.reset_s(0.0) == pytest.approx(taken / (capacity / period), abs=1e-6)
    assert b2.wait_s(capacity + 1, 0.0) == math.inf


@settings(max_examples=200, deadline=None)
@given(tpm=st.integers(50, 5000), rpm=st.one_of(st.none(), st.integers(1, 100)), ops=steps)
def test_book_holds_every_limit_of_a_key(tpm: int, rpm: int | None, ops) -> None:
    """A key's tokens/minute and requests/minute both hold, with settlement to usage."""
    clock = Clock()
    book = QuotaBook(clock)
    k = key(Quotas(tokens_per_minute=tpm, requests_per_minute=rpm))
    start = clock.t
    tokens: list[tuple[float, float]] = []
    requests: list[float] = []
    for dt, cost, used in ops:
        clock.t += dt
        d = book.admit(k, "m", cost)
        status = d.status
        assert status.limit_tokens == tpm and 0 <= status.remaining_tokens <= tpm
        if not d.admitted:
            assert d.retry_after_s > 0 or d.never
            assert d.never == (cost > tpm) or d.reason == "rpm"
            continue
        actual = math.floor(cost * used)
        book.settle(d.reservation, actual)
        tokens.append((clock.t, actual))
        requests.append(clock.t)
    for i, (t0, _) in enumerate(tokens):
        net = 0.0
        for t1, amount in tokens[i:]:
            net += amount
            assert net <= tpm + tpm / 60 * (t1 - t0) + EPS
    if rpm is not None:
        for i, t0 in enumerate(requests):
            for j in range(i, len(requests)):
                assert j - i + 1 <= rpm + rpm / 60 * (requests[j] - t0) + EPS
    assert clock.t >= start


@settings(max_examples=150, deadline=None)
@given(
    tpm=st.integers(100, 5000),
    share=st.floats(0.05, 0.95),
    ops=st.lists(st.tuples(st.floats(0, 3), st.integers(1, 300), st.booleans()), max_size=80),
)
def test_two_regions_with_shares_hold_the_global_budget(tpm: int, share: float, ops) -> None:
    """Two gateways, each on its share: together within the key's budget plus refill."""
    clock = Clock()
    books = {"east": QuotaBook(clock), "west": QuotaBook(clock)}
    k = key(Quotas(tokens_per_minute=tpm), {"east": share, "west": 1 - share})
    admitted: list[tuple[float, int]] = []
    for dt, cost, east in ops:
        clock.t += dt
        cluster = "east" if east else "west"
        d = books[cluster].admit(k, "m", cost, share_of(k, cluster))
        if d.admitted:
            admitted.append((clock.t, cost))
    for i, (t0, _) in enumerate(admitted):
        net = 0
        for t1, amount in admitted[i:]:
            net += amount
            assert net <= tpm + tpm / 60 * (t1 - t0) + 2 + EPS  # +2: each bucket's floor of 1


def test_a_share_change_never_adds_tokens_at_once() -> None:
    clock = Clock()
    book = QuotaBook(clock)
    k = key(Quotas(tokens_per_minute=1000), {"east": 0.5, "west": 0.5})
    assert book.admit(k, "m", 400, 0.5).admitted  # 100 left of 500
    d = book.admit(k, "m", 150, 0.5)
    assert not d.admitted and d.status.remaining_tokens == 100
    # a larger share keeps the level and refills at the new rate (800/min)
    grown = book.status(k, "m", 0.8)
    assert grown.remaining_tokens == 100 and grown.limit_tokens == 800
    clock.t += 3
    assert book.status(k, "m", 0.8).remaining_tokens == 100 + 40
    # a smaller one cuts the level to its capacity
    small = book.status(k, "m", 0.1)
    assert small.remaining_tokens == 100 and small.limit_tokens == 100


@settings(max_examples=200, deadline=None)
@given(
    tpm=st.integers(100, 5000),
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("req"), st.floats(0, 2), st.integers(1, 300), st.sampled_from(["east", "west"])
            ),
            st.tuples(
                st.just("share"), st.floats(0, 2), st.floats(0.05, 0.95), st.sampled_from(["east", "west"])
            ),
        ),
        max_size=80,
    ),
)
# both regions spend their halves, then east applies a smaller share at the same clock time
@example(tpm=100, ops=[("req", 0.0, 50, "east"), ("req", 0.0, 50, "west"), ("share", 0.0, 0.05, "east")])
def test_regions_applying_share_moves_at_different_times(tpm: int, ops) -> None:
    """Each region applies a new split when it hears of it (not at the same time). Tokens
    admitted in any interval stay within what the applied capacities at its start plus the
    applied refill rates over it allow; with shares summing to 1 that is L(1 + T/W). An
    interval starts at an admission, so its capacities are the split applied when that
    admission was made: a share applied later at the same clock time does not count."""
    clock = Clock()
    books = {"east": QuotaBook(clock), "west": QuotaBook(clock)}
    applied = {"east": 0.5, "west": 0.5}
    events: list[tuple[float, float, dict[str, float]]] = []  # admissions, with the split applied then
    timeline: list[tuple[float, dict[str, float]]] = [(clock.t, dict(applied))]
    k = key(Quotas(tokens_per_minute=tpm))
    for cluster, book in books.items():  # the gateway primes a key's buckets when it loads the key
        book.prime([k], applied[cluster])
    for kind, dt, value, cluster in ops:
        clock.t += dt
        if kind == "share":
            applied[cluster] = value  # the other region still has the old split
            books[cluster].status(k, "m", value)
            timeline.append((clock.t, dict(applied)))
        else:
            d = books[cluster].admit(k, "m", value, applied[cluster])
            if d.admitted:
                events.append((clock.t, value, dict(applied)))

    def shares_at(t: float) -> dict[str, float]:
        return [s for at, s in timeline if at <= t][-1]

    def refill(t0: float, t1: float) -> float:
        total, points = 0.0, [t0] + [at for at, _ in timeline if t0 < at < t1] + [t1]
        for a, b in itertools.pairwise(points):
            total += sum(shares_at(a).values()) * tpm / 60 * (b - a)
        return total

    for i, (t0, _, split) in enumerate(events):
        net = 0.0
        capacity = sum(max(1.0, s * tpm) for s in split.values())
        for t1, amount, _ in events[i:]:
            net += amount
            assert net <= capacity + refill(t0, t1) + 2 + EPS


def test_per_deployment_limits_and_binding_headers() -> None:
    clock = Clock()
    book = QuotaBook(clock)
    q = Quotas(
        tokens_per_minute=1000,
        requests_per_minute=10,
        deployments={"big": DeploymentLimits(tokens_per_minute=100)},
    )
    k = key(q)
    assert [lim.name for lim in limits_for(q, "big", 1.0)] == ["tpm", "rpm", "big:tpm"]
    d = book.admit(k, "big", 80)
    assert d.admitted
    headers = d.status.headers()
    assert headers["x-ratelimit-limit-tokens"] == "100"  # the binding one
    assert headers["x-ratelimit-remaining-tokens"] == "20"
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "9"
    refused = book.admit(k, "big", 50)
    assert not refused.admitted and refused.reason == "big:tpm"
    assert refused.retry_after_s == pytest.approx(30 / (100 / 60))
    assert book.admit(k, "small", 500).admitted  # other deployments: only the key's limits


def test_tokens_per_day() -> None:
    clock = Clock()
    book = QuotaBook(clock, minute_s=1.0)  # a "day" of 1440 s
    k = key(Quotas(tokens_per_day=1440))
    assert book.admit(k, "m", 1440).admitted
    assert not book.admit(k, "m", 10).admitted
    clock.t += 10
    assert book.admit(k, "m", 10).admitted  # 1 token/s


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.12, "120ms"),
        (1.5, "1.5s"),
        (59.95, "60s"),
        (360, "6m0s"),
        (3723, "1h2m3s"),
    ],
)
def test_reset_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_share_of() -> None:
    assert share_of(key(Quotas()), "x") == 1.0
    k = key(Quotas(), {"a": 0.7, "b": 0.3})
    assert share_of(k, "a") == 0.7 and share_of(k, "new") == 0.3


# --------------------------------------------------------------------- priority waitlist


@settings(max_examples=300, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from(["interactive", "standard", "batch"]), st.floats(0, 2)), max_size=40
    ),
    age=st.floats(0.5, 5),
    gaps=st.lists(st.floats(0, 1), min_size=40, max_size=40),
)
def test_waitlist_order(arrivals, age: float, gaps: list[float]) -> None:
    """Pops: an overdue waiter (oldest first) before anyone else, else the best class, FIFO;
    a batch waiter is never overdue."""
    wl = PriorityWaitlist(max_age_s=age)
    now = 0.0
    waiting = []
    for klass, dt in arrivals:
        now += dt
        waiting.append(wl.add(klass, now))
    rank = {"interactive": 0, "standard": 1, "batch": 2}
    for gap in gaps:
        if not waiting:
            break
        now += gap
        got = wl.pop(now)
        overdue = [w for w in waiting if w.klass != "batch" and now - w.arrived >= age]
        if overdue:
            assert got is min(overdue, key=lambda w: (w.arrived, w.seq))
        else:
            assert got is min(waiting, key=lambda w: (rank[w.klass], w.seq))
        waiting.remove(got)
    assert len(wl) == len(waiting)


def test_waitlist_unknown_class_is_the_default() -> None:
    wl = PriorityWaitlist()
    assert wl.add("gold", 0.0).klass == "standard"
    assert wl.klass(None) == "standard"
    assert PriorityWaitlist(classes=("a", "b")).klass("zzz") == "b"
