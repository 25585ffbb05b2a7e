"""The lease store on SQLite and PostgreSQL: one winner per compare-and-set, renew only by
the holder of the epoch, release hands over at once, members heartbeat and leave."""

from __future__ import annotations

import threading

import pytest

from control_plane.db.models import utcnow
from control_plane.ha.election import LeaseRecord
from control_plane.ha.lease_store import LeaseStore


def test_first_acquire_creates_the_lease_once(db_sessions, lease_name):
    a, b = LeaseStore(db_sessions, lease_name), LeaseStore(db_sessions, lease_name)
    assert a.read() is None
    assert a.acquire("a", None, 15.0) == LeaseRecord("a", 1, 1, 15.0)
    assert b.acquire("b", None, 15.0) is None  # it exists now: b read a stale None
    assert b.read() == LeaseRecord("a", 1, 1, 15.0)


def test_compare_and_set_has_one_winner_among_concurrent_candidates(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    seen = store.acquire("a", None, 15.0)
    results: list = []
    barrier = threading.Barrier(4)

    def take(me: str) -> None:
        barrier.wait()
        results.append(store.acquire(me, seen, 15.0))

    threads = [threading.Thread(target=take, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if r is not None]
    assert len(won) == 1
    assert store.read() == won[0] and won[0].epoch == 2 and won[0].version == 2


def test_renew_only_by_the_holder_of_the_epoch(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    first = store.acquire("a", None, 15.0)
    renewed = store.renew("a", first.epoch)
    assert renewed == LeaseRecord("a", 1, 2, 15.0)  # the version moves, the epoch stays
    assert store.renew("b", first.epoch) is None
    assert store.renew("a", first.epoch + 1) is None
    taken = store.acquire("b", renewed, 15.0)
    assert taken.epoch == 2
    assert store.renew("a", first.epoch) is None  # the old leader's renew is refused
    assert store.acquire("a", renewed, 15.0) is None  # and so is its acquire on a stale read


def test_release_frees_it_for_a_successor_at_once(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    lease = store.acquire("a", None, 15.0)
    assert not store.release("b", lease.epoch)
    assert store.release("a", lease.epoch)
    freed = store.read()
    assert freed.holder is None and freed.epoch == 1 and freed.version == 2
    assert store.acquire("b", freed, 15.0).epoch == 2


def test_members_heartbeat_and_leave(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    started = utcnow()
    store.heartbeat(f"{lease_name}-a", "http://a", started)
    store.heartbeat(f"{lease_name}-b", "http://b", started)
    store.heartbeat(f"{lease_name}-a", "http://a2", started)
    mine = {m.id: m for m in store.members() if m.id.startswith(lease_name)}
    assert set(mine) == {f"{lease_name}-a", f"{lease_name}-b"}
    assert mine[f"{lease_name}-a"].url == "http://a2"
    before = mine[f"{lease_name}-b"].last_seen
    store.heartbeat(f"{lease_name}-b", "http://b", started)
    assert next(m for m in store.members() if m.id == f"{lease_name}-b").last_seen >= before
    store.leave(f"{lease_name}-a")
    store.leave(f"{lease_name}-b")
    assert not [m for m in store.members() if m.id.startswith(lease_name)]


def test_raise_epoch_jumps_above_the_floor_only_for_the_holder_of_the_epoch(db_sessions, lease_name):
    """A fresh database (epoch 1) under buckets and agents at epoch 7: the holder takes 8."""
    store = LeaseStore(db_sessions, lease_name)
    first = store.acquire("a", None, 15.0)
    assert store.raise_epoch("b", first.epoch, 7) is None  # not the holder
    assert store.raise_epoch("a", first.epoch + 1, 7) is None  # not its epoch
    raised = store.raise_epoch("a", first.epoch, 7)
    assert raised == LeaseRecord("a", 8, 2, 15.0) and store.read() == raised
    assert store.raise_epoch("a", first.epoch, 9) is None  # the old epoch is gone
    assert store.renew("a", 8) == LeaseRecord("a", 8, 3, 15.0)
    assert store.renew("a", first.epoch) is None


def test_raise_epoch_loses_to_a_successor_that_acquired_first(db_sessions, lease_name):
    """The wire's epoch belongs to a live successor: the old holder's raise is refused."""
    store = LeaseStore(db_sessions, lease_name)
    old = store.acquire("a", None, 15.0)
    successor = store.acquire("b", old, 15.0)
    assert store.raise_epoch("a", old.epoch, successor.epoch) is None
    assert store.read() == successor


def test_raise_epoch_refuses_a_floor_below_the_epoch_held(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    lease = store.acquire("a", None, 15.0)
    store.raise_epoch("a", lease.epoch, 4)
    with pytest.raises(ValueError):
        store.raise_epoch("a", 5, 3)
