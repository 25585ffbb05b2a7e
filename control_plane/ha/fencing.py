"""Sessions for a leader's loops whose every commit is refused once their epoch is over.

Before each commit the session flushes (so on SQLite it holds the database's write lock)
and re-reads the lease's epoch in the same transaction, `FOR SHARE` on PostgreSQL (a
successor's acquire, an UPDATE of that row, waits for this commit). Either the commit lands
before the successor's acquire, or it sees the new epoch and raises `Fenced`: a paused
leader that wakes up cannot write over its successor's decisions.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import event, select, text
from sqlalchemy.orm import Session, sessionmaker

from control_plane.db.models import ControlPlaneLease
from control_plane.ha import LEASE_NAME


class Fenced(Exception):
    """This transaction belongs to an epoch the lease has moved past."""

    def __init__(self, epoch: int, current: int | None) -> None:
        super().__init__(f"fenced: commit under epoch {epoch}, the lease is at {current}")
        self.epoch = epoch
        self.current = current


def current_epoch(session: Session, lease_name: str = LEASE_NAME) -> int | None:
    """The lease's epoch, read inside the session's transaction with a shared row lock."""
    query = select(ControlPlaneLease.epoch).where(ControlPlaneLease.name == lease_name)
    return session.execute(query.with_for_update(read=True)).scalar_one_or_none()


def hold_lease_briefly(session: Session, hold_timeout_s: float | None) -> None:
    """On PostgreSQL, end this transaction if it sits idle over `hold_timeout_s` from now on:
    a leader paused between its FOR SHARE check and its COMMIT (a few milliseconds when
    alive) must not hold a successor's acquire up."""
    if hold_timeout_s is None or session.get_bind().dialect.name != "postgresql":
        return
    hold_ms = str(max(1, round(hold_timeout_s * 1000)))
    session.execute(
        text("SELECT set_config('idle_in_transaction_session_timeout', :ms, true)"), {"ms": hold_ms}
    )


def fenced_sessions(
    sessions: sessionmaker[Session],
    lease_name: str,
    epoch: int,
    on_fenced: Callable[[Fenced], None] | None = None,
    hold_timeout_s: float | None = None,
) -> sessionmaker[Session]:
    """A factory like `sessions` (same engine and options) whose commits check `epoch`;
    `on_fenced` hears every refusal (the elector demotes at once, whatever the loop does
    with the exception); `hold_timeout_s` bounds how long a commit may hold the lease row."""
    fenced = sessionmaker(**sessions.kw)

    @event.listens_for(fenced, "before_commit")
    def _check(session: Session) -> None:
        if session.in_nested_transaction() and session.get_bind().dialect.name != "sqlite":
            # A savepoint's release (SQLAlchemy fires before_commit for it too): the outer commit
            # checks. Not on SQLite, where the driver opens no transaction before a SAVEPOINT, so
            # releasing the first one commits unless `begin_write` opened one: there each
            # release is checked (a local read).
            return
        session.flush()  # take the write lock (SQLite) before the check, not after
        hold_lease_briefly(session, hold_timeout_s)
        current = current_epoch(session, lease_name)
        if current != epoch:
            refused = Fenced(epoch, current)
            if on_fenced is not None:
                on_fenced(refused)
            raise refused

    fenced.fencing_epoch = epoch  # type: ignore[attr-defined]
    return fenced
