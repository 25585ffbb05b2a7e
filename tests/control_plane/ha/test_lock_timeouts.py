"""A paused leader's locks cannot hold its successor up: the lease writes wait for a row lock
at most their lock timeout, and PostgreSQL ends a fenced commit's transaction that sits idle
with the lease row locked once the hold timeout has passed; the elector's database calls are
bounded too."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from sqlalchemy.exc import DBAPIError, OperationalError

from control_plane.context import ControlPlaneContext
from control_plane.db.session import make_engine
from control_plane.ha.elector import Elector
from control_plane.ha.fencing import current_epoch, hold_lease_briefly
from control_plane.ha.lease_store import LeaseStore
from control_plane.settings import Settings

LOCK_S, HOLD_S = 0.3, 1.0


def test_a_paused_fenced_commit_does_not_block_the_successors_acquire(db_sessions, lease_name):
    if db_sessions.kind != "postgresql":
        pytest.skip("row locks and the idle timeout are PostgreSQL's")
    store = LeaseStore(db_sessions, lease_name, lock_timeout_s=LOCK_S, hold_timeout_s=HOLD_S)
    old = store.acquire("old", None, 15.0)
    paused = db_sessions()
    try:
        hold_lease_briefly(paused, HOLD_S)  # as the fenced commit does before its check
        assert current_epoch(paused, lease_name) == old.epoch  # FOR SHARE held; then the leader pauses
        seen = store.read()
        began = time.monotonic()
        with pytest.raises(OperationalError, match="lock timeout"):
            store.acquire("new", seen, 15.0)
        waited = time.monotonic() - began
        assert waited < LOCK_S + 0.5  # not indefinitely: the successor's round goes on
        time.sleep(HOLD_S + 0.3 - waited)
        won = store.acquire("new", seen, 15.0)  # the server ended the paused transaction
        assert won is not None and won.epoch == old.epoch + 1
        with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):
            paused.commit()  # the paused leader wakes up: its transaction is gone
    finally:
        with contextlib.suppress(DBAPIError):
            paused.close()


def test_the_control_planes_connections_carry_keepalives_and_the_idle_timeout(db_sessions):
    if db_sessions.kind != "postgresql":
        pytest.skip("PostgreSQL connection settings")
    url = db_sessions.kw["bind"].url.render_as_string(hide_password=False)
    engine = make_engine(url, idle_in_transaction_s=25.0)
    try:
        with engine.connect() as conn:
            show = {
                name: conn.exec_driver_sql(f"SHOW {name}").scalar()
                for name in ("idle_in_transaction_session_timeout", "tcp_keepalives_idle")
            }
    finally:
        engine.dispose()
    assert show["idle_in_transaction_session_timeout"] == "25s"
    assert show["tcp_keepalives_idle"] in ("5", "5s", "0")  # 0 where the server is on a Unix socket


async def test_a_hung_database_call_does_not_hang_the_election(sessions):
    settings = Settings(leader_lease_s=1.5, leader_renew_deadline_s=1.0, leader_retry_s=0.15)
    elector = Elector(ControlPlaneContext(settings=settings, sessions=sessions), lambda _ctx: None)
    hung = threading.Event()
    elector.store.read = lambda: hung.wait(30)
    try:
        began = time.monotonic()
        await elector.step()  # the read times out: a failed round, not a stuck one
        assert time.monotonic() - began < elector.call_timeout_s + 0.5
        assert not elector.candidate.leading
    finally:
        hung.set()
        await asyncio.sleep(0)
