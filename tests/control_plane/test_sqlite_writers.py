"""Writers beside each other on the default SQLite database: the control plane's loops run
in threads, each with its own connection, and WAL lets a transaction that read before it
writes fail at once ("database is locked") when another committed in between. Heartbeats
(read the cluster, then update it) must be stored anyway, and a store that finds the
database unavailable must fail its batch whole (redelivered), never mark a message poison."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from control_plane.counters import Rejections
from control_plane.db import models as m
from control_plane.db.session import unavailable
from control_plane.loops import store
from control_plane.loops.durable import Received
from control_plane.loops.ingest import store_event_batch, write_heartbeats
from fleet_base import protocol
from tests.control_plane.test_loops import heartbeat


def test_heartbeats_are_stored_while_another_writer_commits(sessions) -> None:
    write_heartbeats(sessions, [heartbeat("c1"), heartbeat("c2")], m.utcnow(), Rejections())
    stop, other_commits = threading.Event(), [0]

    def other_writer() -> None:  # another loop: commits to another row, as fast as it can
        while not stop.is_set():
            with sessions() as s:
                s.get(m.Cluster, "c2").load = {"queue_depth": other_commits[0]}
                s.commit()
            other_commits[0] += 1

    rejections = Rejections()
    thread = threading.Thread(target=other_writer)
    thread.start()
    stored = 0
    try:
        # Until both have committed often: SQLite's lock is not fair (a waiting writer's busy
        # handler sleeps while this loop re-takes the lock), so on a loaded machine the other
        # writer may need more than a few seconds to get its turns; no rejection is the point.
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not (other_commits[0] > 10 and stored > 10):
            write_heartbeats(sessions, [heartbeat("c1", queue_depth=stored)], m.utcnow(), rejections)
            stored += 1
    finally:
        stop.set()
        thread.join()
    assert other_commits[0] > 10 and stored > 10, (other_commits, stored)
    assert not rejections.counts, rejections.counts
    with sessions() as s:
        assert s.get(m.Cluster, "c1").load["queue_depth"] == stored - 1


def _three_events(prefix: str) -> list[Received]:
    events = [protocol.Event(cluster="c1", kind="replica_ready", message=f"{prefix}{i}") for i in range(3)]
    return [Received(protocol.events_subject("c1"), e.to_bytes(), i + 1) for i, e in enumerate(events)]


def _insert_failing_on(monkeypatch, message: str, error: str) -> None:
    """`store.insert_once`, raising OperationalError(`error`) for the row whose message is `message`."""
    real = store.insert_once

    def insert(session, table, values, key):
        if values["message"] == message:
            raise OperationalError("INSERT", {}, Exception(error))
        return real(session, table, values, key)

    monkeypatch.setattr(store, "insert_once", insert)


def _stored(sessions, prefix: str) -> int:
    with sessions() as s:
        return s.query(m.Event).filter(m.Event.message.like(f"{prefix}%")).count()


def test_an_unavailable_database_fails_the_batch_instead_of_poisoning_it(sessions, monkeypatch) -> None:
    batch = _three_events("m")
    _insert_failing_on(monkeypatch, "m1", "database is locked")
    rejections = Rejections()
    with pytest.raises(OperationalError):
        store_event_batch(sessions, batch, rejections)
    assert not rejections.counts  # nothing counted as refused: the whole batch comes again
    assert _stored(sessions, "m") == 0  # nor half stored
    monkeypatch.undo()
    assert store_event_batch(sessions, batch, rejections).poison == set()
    assert _stored(sessions, "m") == 3


def test_a_statement_the_database_cannot_run_is_poison_not_retried_forever(sessions, monkeypatch) -> None:
    _insert_failing_on(monkeypatch, "n1", "no such column: foo")
    rejections = Rejections()
    assert store_event_batch(sessions, _three_events("n"), rejections).poison == {1}
    assert rejections.counts[(protocol.EVENTS_WILDCARD, "database")] == 1
    assert _stored(sessions, "n") == 2


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("orig", "invalidated", "retry"),
    [
        (Exception("database is locked"), False, True),
        (Exception("no such table: usage_records"), False, False),
        (Exception("server closed the connection"), True, True),
        (_PgError("55P03"), False, True),  # lock_not_available
        (_PgError("08006"), False, True),  # connection_failure
        (_PgError("40P01"), False, True),  # deadlock_detected
        (_PgError("54000"), False, False),  # program_limit_exceeded: this statement, always
        (_PgError("53100"), False, True),  # disk_full: kept until there is room (and logged each time)
        (Exception("database or disk is full"), False, True),
    ],
)
def test_unavailable_tells_not_now_from_not_this(orig, invalidated, retry) -> None:
    err = OperationalError("SELECT 1", {}, orig, connection_invalidated=invalidated)
    assert unavailable(err) is retry
