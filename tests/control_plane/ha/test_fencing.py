"""Fenced sessions on SQLite and PostgreSQL: a paused leader's commit after its successor
acquired is refused, and the successor's acquire cannot slip in between a fenced commit's
check and its commit."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import event, select

from control_plane.db.models import TeamBudget
from control_plane.ha.fencing import Fenced, fenced_sessions
from control_plane.ha.lease_store import LeaseStore


def _budget(session, team: str) -> None:
    session.add(TeamBudget(team=team, monthly_dollars=1.0, thresholds=[1.0], alerted={}))


def _teams(sessions, prefix: str) -> set[str]:
    with sessions() as session:
        return set(session.scalars(select(TeamBudget.team).where(TeamBudget.team.like(f"{prefix}%"))))


def test_a_paused_leaders_commit_after_a_takeover_is_refused(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    old = store.acquire("old", None, 15.0)
    heard: list[Fenced] = []
    leader = fenced_sessions(db_sessions, lease_name, old.epoch, on_fenced=heard.append)
    with leader() as session:
        _budget(session, f"{lease_name}-before")
        session.commit()  # its own epoch: lands
    paused = leader()
    _budget(paused, f"{lease_name}-stale")  # prepared before the pause
    new = store.acquire("new", store.read(), 15.0)
    successor = fenced_sessions(db_sessions, lease_name, new.epoch)
    with successor() as session:
        _budget(session, f"{lease_name}-after")
        session.commit()
    with pytest.raises(Fenced) as refused:
        paused.commit()  # the old leader wakes up
    paused.close()
    assert refused.value.epoch == old.epoch and refused.value.current == new.epoch
    assert heard and heard[0] is refused.value
    assert _teams(db_sessions, lease_name) == {f"{lease_name}-before", f"{lease_name}-after"}


def test_a_takeover_waits_for_an_in_flight_fenced_commit(db_sessions, lease_name):
    store = LeaseStore(db_sessions, lease_name)
    old = store.acquire("old", None, 15.0)
    seen = store.read()
    leader = fenced_sessions(db_sessions, lease_name, old.epoch)
    taken: list = []
    takeover = threading.Thread(target=lambda: taken.append(store.acquire("new", seen, 15.0)))
    blocked: list[bool] = []

    @event.listens_for(leader, "before_commit")  # runs after the fencing check
    def _race(_session) -> None:
        takeover.start()
        time.sleep(0.5)
        blocked.append(takeover.is_alive())

    with leader() as session:
        _budget(session, f"{lease_name}-in-flight")
        session.commit()
    takeover.join(10)
    assert blocked == [True]  # the acquire waited for the commit holding the lease row
    assert taken and taken[0] is not None and taken[0].epoch == old.epoch + 1
    assert _teams(db_sessions, lease_name) == {f"{lease_name}-in-flight"}
    event.remove(leader, "before_commit", _race)
    with pytest.raises(Fenced), leader() as session:
        _budget(session, f"{lease_name}-late")
        session.commit()
    assert _teams(db_sessions, lease_name) == {f"{lease_name}-in-flight"}


def test_savepoints_are_not_checked_one_by_one_only_the_commit_is(db_sessions, lease_name):
    """On PostgreSQL a batch written in savepoints (heartbeats, events) costs one FOR SHARE
    round trip, at the outer commit, and a refused batch is reported once. On SQLite (whose
    driver commits at the release of a savepoint opened outside a transaction) each release
    is checked, and a refused batch writes nothing either way."""
    store = LeaseStore(db_sessions, lease_name)
    old = store.acquire("old", None, 15.0)
    heard: list[Fenced] = []
    leader = fenced_sessions(db_sessions, lease_name, old.epoch, on_fenced=heard.append)
    reads: list[str] = []
    engine = db_sessions.kw["bind"]

    def count(_conn, _cursor, statement, *_args) -> None:
        if statement.startswith("SELECT control_plane_lease.epoch"):
            reads.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with leader() as session:
            for i in range(5):
                with session.begin_nested():
                    _budget(session, f"{lease_name}-ok-{i}")
            session.commit()
        per_commit = 1 if db_sessions.kind == "postgresql" else 5 + 1  # each release, then the commit
        assert len(reads) == per_commit and heard == []
        store.acquire("new", store.read(), 15.0)
        with leader() as session, pytest.raises(Fenced):
            for i in range(5):
                with session.begin_nested():
                    _budget(session, f"{lease_name}-stale-{i}")
            session.commit()
        assert len(reads) == per_commit + 1 and len(heard) == 1
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert (
        len(_teams(db_sessions, f"{lease_name}-ok-")) == 5
        and _teams(db_sessions, f"{lease_name}-stale-") == set()
    )
