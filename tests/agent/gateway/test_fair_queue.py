"""Fair queueing between keys (agent.gateway.priority) and per-key concurrency at the
gateway's queue (agent.gateway.queue): table tests and seeded property tests."""

from __future__ import annotations

import asyncio
import collections

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from agent.gateway.errors import GatewayError
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.priority import PriorityWaitlist, Waiter
from agent.gateway.queue import ReplicaQueue

# --------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("arrivals", "expected"),
    [
        # one key: FIFO, as before
        ("a1 a2 a3", "a1 a2 a3"),
        # a flood of a, then b: b's first request goes after at most one of a's
        ("a1 a2 a3 a4 b1", "a1 b1 a2 a3 a4"),
        ("a1 a2 a3 b1 b2 c1", "a1 b1 c1 a2 b2 a3"),
        # a key that was just served goes behind the others
        ("a1 b1 a2 b2", "a1 b1 a2 b2"),
    ],
)
def test_keys_take_turns(arrivals: str, expected: str) -> None:
    wl = PriorityWaitlist()
    names = {}
    for i, name in enumerate(arrivals.split()):
        names[wl.add("standard", float(i), key=name[0]).seq] = name
    got = []
    while (w := wl.pop(10.0)) is not None:
        got.append(names[w.seq])
    assert " ".join(got) == expected


def test_classes_rank_before_turns_and_overdue_classes_go_first() -> None:
    wl = PriorityWaitlist(max_age_s=5.0)
    s = wl.add("standard", 0.0, key="a")
    i = [wl.add("interactive", 1.0, key="a"), wl.add("interactive", 2.0, key="b")]
    j = wl.add("interactive", 3.0, key="c")
    assert wl.pop(3.0) is i[0]
    assert wl.pop(3.0) is i[1]
    assert wl.pop(5.5) is s  # overdue: standard's waiter is 5.5 s old
    assert wl.pop(5.5) is j
    assert len(wl) == 0 and wl.pop(6.0) is None


@pytest.mark.parametrize(
    ("ahead", "batch_age", "first"),
    [
        ("interactive", 0.0, "interactive"),
        ("interactive", 5.0, "interactive"),
        ("interactive", 3600.0, "interactive"),
        ("standard", 5.0, "standard"),
        ("standard", 3600.0, "standard"),
        (None, 3600.0, "batch"),
    ],
)
def test_batch_never_becomes_overdue_ahead_of_other_classes(
    ahead: str | None, batch_age: float, first: str
) -> None:
    wl = PriorityWaitlist(max_age_s=5.0)
    wl.add("batch", 0.0, key="a")
    if ahead is not None:
        wl.add(ahead, batch_age, key="b")
    popped = wl.pop(batch_age)
    assert popped is not None and popped.klass == first


def test_ineligible_keys_are_passed_over_and_keep_their_turn() -> None:
    wl = PriorityWaitlist()
    a1, a2, b1, b2 = (wl.add("standard", t, key=k) for t, k in enumerate("aabb"))
    at_limit = {"a"}
    assert wl.pop(9.0, lambda k: k not in at_limit) is b1
    assert wl.pop(9.0, lambda k: k not in at_limit) is b2
    assert wl.pop(9.0, lambda k: k not in at_limit) is None
    assert wl.pop(9.0) is a1 and wl.pop(9.0) is a2
    assert wl.of_key("a") == 0


Op = tuple[str, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3)),
        st.tuples(st.just("pop"), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
    ),
    max_size=120,
)


@seed(32)
@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_no_key_waits_behind_more_than_its_rank_of_another_keys_requests(ops: list[Op]) -> None:
    """A request that was the i-th of its key waiting in its class is passed by at most i
    requests of any other key before it is served, whatever arrives or leaves meanwhile;
    each key's own requests are served FIFO."""
    wl = PriorityWaitlist()
    waiting: list[Waiter] = []
    rank: dict[int, int] = {}
    passed: dict[int, collections.Counter[str]] = {}
    served: dict[str, list[int]] = collections.defaultdict(list)
    clock = 0.0
    for op, arg in ops:
        clock += 0.001
        if op == "add":
            key = "abcd"[arg]
            w = wl.add("standard", clock, key=key)
            rank[w.seq] = wl.of_key(key)
            passed[w.seq] = collections.Counter()
            waiting.append(w)
        elif op == "remove" and waiting:
            w = waiting.pop(arg % len(waiting))
            wl.remove(w)
        elif op == "pop":
            w = wl.pop(clock)
            assert (w is None) == (not waiting)
            if w is None:
                continue
            waiting.remove(w)
            assert max(passed[w.seq].values(), default=0) <= rank[w.seq], (w, passed[w.seq])
            for other in waiting:
                if other.key != w.key:
                    passed[other.seq][w.key] += 1
            served[w.key].append(w.seq)
        assert len(wl) == len(waiting)
    for seqs in served.values():
        assert seqs == sorted(seqs)


# --------------------------------------------------------------------- the queue


class _View:
    """Always one ready replica; reloads never happen."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def ready(self, deployment: str) -> list[int]:
        return [1]

    def route(self, deployment: str) -> None:
        return None

    def changed(self) -> asyncio.Event:
        return self._changed


def _queue(size: int, slots: int, share: float = 0.5) -> ReplicaQueue:
    q = ReplicaQueue(_View(), size, 5.0, GatewayMetrics())  # type: ignore[arg-type]
    q.capacity = lambda deployment: slots
    q.key_share = share
    return q


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_max_concurrent_holds_slots_others_pass_and_over_share_is_429() -> None:
    q = _queue(size=4, slots=4)  # a key may hold 2 of the 4 queue places
    assert await q.admit("d", "standard", "a", 2) == 0.0
    assert await q.admit("d", "standard", "a", 2) == 0.0
    waiting = [asyncio.create_task(q.admit("d", "standard", "a", 2)) for _ in range(2)]
    await _settle()
    assert q.key_waiting("a") == 2 and q.active["d"] == 2  # free slots, but not for a
    with pytest.raises(GatewayError) as refused:
        await q.admit("d", "standard", "a", 2)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert "max_concurrent is 2" in refused.value.message and refused.value.headers["Retry-After"]
    assert await q.admit("d", "standard", "b") == 0.0  # another key passes a's waiters at once
    q.release("d", "a")
    await _settle()
    assert sum(t.done() for t in waiting) == 1 and q.key_active["a"] == 2
    for _ in range(2):
        q.release("d", "a")
    await asyncio.wait_for(asyncio.gather(*waiting), 1)
    assert q.key_active["a"] == 1 and q.active["d"] == 2  # b still holds its slot


async def test_a_wait_ended_by_the_keys_own_limit_is_429_and_one_ended_by_load_is_503() -> None:
    q = _queue(size=8, slots=2)
    q.timeout_s = 0.05
    assert await q.admit("d", "standard", "a", 1) == 0.0
    with pytest.raises(GatewayError) as own:  # a slot is free; a's own limit holds it
        await q.admit("d", "standard", "a", 1)
    assert own.value.status == 429 and own.value.code == "rate_limit_exceeded"
    assert "max_concurrent (1)" in own.value.message and own.value.headers["Retry-After"]
    assert await q.admit("d", "standard", "b") == 0.0  # both slots taken now
    with pytest.raises(GatewayError) as busy:  # c has no limit: the deployment is full
        await q.admit("d", "standard", "c")
    assert busy.value.status == 503 and busy.value.code == "queue_timeout"
    assert q.depth == 0


async def test_a_key_without_limit_is_held_to_its_share_of_the_queue() -> None:
    q = _queue(size=4, slots=1)
    assert await q.admit("d", "standard", "a") == 0.0
    waiting = [asyncio.create_task(q.admit("d", "standard", "a")) for _ in range(2)]
    await _settle()
    with pytest.raises(GatewayError) as refused:
        await q.admit("d", "standard", "a")
    assert refused.value.status == 429 and "share of this gateway's queue (2 of 4)" in refused.value.message
    other = asyncio.create_task(q.admit("d", "standard", "b"))  # room left for other keys
    await _settle()
    q.release("d", "a")
    await _settle()
    assert waiting[0].done() and not other.done()  # a's first came before b
    q.release("d", "a")
    await _settle()
    assert other.done() and not waiting[1].done()  # b's turn came before a's second
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert q.depth == 0 and q.key_waiting("a") == 0


async def test_a_keys_release_wakes_its_waiter_on_another_deployment() -> None:
    q = _queue(size=8, slots=4)
    assert await q.admit("d1", "standard", "a", 1) == 0.0
    other = asyncio.create_task(q.admit("d2", "standard", "a", 1))
    await _settle()
    assert not other.done() and q.waiting("d2") == 1
    q.release("d1", "a")
    assert await asyncio.wait_for(other, 1) >= 0.0
    assert q.key_active["a"] == 1 and q.active == {"d1": 0, "d2": 1}


@seed(32)
@settings(max_examples=100, deadline=None)
@given(
    plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=40),
    limits=st.tuples(st.integers(1, 3), st.integers(1, 3), st.none()),
)
def test_no_key_ever_holds_more_than_its_max_concurrent(plan: list[tuple[int, bool]], limits) -> None:
    """Random arrivals and releases of three keys (two limited): the slots a key holds never
    exceed its max_concurrent, the deployment's never exceed its target, and every
    request ends admitted or refused (nothing is lost)."""

    async def run() -> None:
        q = _queue(size=6, slots=4)
        held: list[str] = []
        tasks: list[asyncio.Task[float]] = []

        async def one(key: str) -> float:
            t = await q.admit("d", "standard", key, limits["abc".index(key)])
            held.append(key)
            return t

        for k, release in plan:
            tasks.append(asyncio.create_task(one("abc"[k])))
            await _settle()
            if release and held:
                q.release("d", held.pop(0))
                await _settle()
            counts = collections.Counter(held)
            for key, n in counts.items():
                limit = limits["abc".index(key)]
                assert limit is None or n <= limit
            assert len(held) <= 4
        while held:
            q.release("d", held.pop(0))
            await _settle()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert isinstance(r, float) or (isinstance(r, GatewayError) and r.status in (429, 503)), r
        assert q.depth == 0 and not q.key_active

    asyncio.run(run())
