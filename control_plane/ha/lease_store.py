"""The lease and the members in the database: every write is one conditional UPDATE (or an
INSERT that only one process can win), so two candidates can never both succeed.

- acquire: compare-and-set on the `version` the caller read; bumps epoch and version;
- renew: only by the holder of this epoch; bumps the version (what followers watch);
- release: on a clean shutdown, so a successor takes over at once instead of after lease_s;
- raise_epoch: the holder jumps its epoch above one seen on the wire (a database that lost
  its history, see `Elector.raise_floor`); only while it still holds exactly its epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from control_plane.db.models import ControlPlaneLease, ControlPlaneMember, utcnow
from control_plane.ha import LEASE_NAME
from control_plane.ha.election import LeaseRecord


@dataclass(frozen=True)
class Member:
    id: str
    url: str
    started_at: datetime
    last_seen: datetime


def _record(row: ControlPlaneLease) -> LeaseRecord:
    return LeaseRecord(holder=row.holder, epoch=row.epoch, version=row.version, lease_s=row.lease_s)


class LeaseStore:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        name: str = LEASE_NAME,
        *,
        lock_timeout_s: float | None = None,
        hold_timeout_s: float | None = None,
    ) -> None:
        """`lock_timeout_s`: how long an acquire or renew waits for a row lock (PostgreSQL) or
        the write lock (SQLite) before failing, so a paused leader's locks cannot hold a
        successor's round up; `hold_timeout_s`: how long PostgreSQL lets such a transaction
        sit idle before it ends it (a writer paused with the lease row locked)."""
        self.sessions = sessions
        self.name = name
        self.lock_timeout_s = lock_timeout_s
        self.hold_timeout_s = hold_timeout_s

    @contextlib.contextmanager
    def _bounded(self, session: Session) -> Iterator[None]:
        """The lease write's waits, bounded for this transaction only."""
        if self.lock_timeout_s is None:
            yield
            return
        lock_ms = str(max(1, round(self.lock_timeout_s * 1000)))
        dialect = session.get_bind().dialect.name
        if dialect == "postgresql":
            settings = {"lock_timeout": lock_ms}
            if self.hold_timeout_s is not None:
                settings["idle_in_transaction_session_timeout"] = str(
                    max(1, round(self.hold_timeout_s * 1000))
                )
            for name, value in settings.items():
                session.execute(
                    text("SELECT set_config(:name, :value, true)"), {"name": name, "value": value}
                )
            yield
        elif dialect == "sqlite":
            from control_plane.db.session import SQLITE_BUSY_TIMEOUT_MS

            conn = session.connection()
            conn.exec_driver_sql(f"PRAGMA busy_timeout={lock_ms}")  # the connection's: restored below
            try:
                yield
            finally:
                conn.exec_driver_sql(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        else:
            yield

    def read(self) -> LeaseRecord | None:
        with self.sessions() as session:
            row = session.get(ControlPlaneLease, self.name, populate_existing=True)
            return None if row is None else _record(row)

    def acquire(self, me: str, seen: LeaseRecord | None, lease_s: float) -> LeaseRecord | None:
        """The lease for `me` if it is still exactly as `seen`; None if anyone moved it."""
        with self.sessions() as session:
            if seen is None:
                session.add(ControlPlaneLease(name=self.name, holder=me, epoch=1, version=1, lease_s=lease_s))
                try:
                    with self._bounded(session):
                        session.flush()
                    session.commit()
                except IntegrityError:
                    return None  # another candidate created it first
                return LeaseRecord(me, 1, 1, lease_s)
            with self._bounded(session):
                done = session.execute(
                    update(ControlPlaneLease)
                    .where(ControlPlaneLease.name == self.name, ControlPlaneLease.version == seen.version)
                    .values(
                        holder=me,
                        epoch=ControlPlaneLease.epoch + 1,
                        version=ControlPlaneLease.version + 1,
                        lease_s=lease_s,
                        renewed_at=utcnow(),
                    )
                )
            session.commit()
            if done.rowcount != 1:
                return None
        return LeaseRecord(me, seen.epoch + 1, seen.version + 1, lease_s)

    def _held_update(self, me: str, held: int, **values):
        """An UPDATE of the lease that lands only while `me` holds epoch `held`; it moves the
        version on, as every write a follower must notice does."""
        return (
            update(ControlPlaneLease)
            .where(
                ControlPlaneLease.name == self.name,
                ControlPlaneLease.holder == me,
                ControlPlaneLease.epoch == held,
            )
            .values(version=ControlPlaneLease.version + 1, renewed_at=utcnow(), **values)
        )

    def _read_back(self, session, done) -> LeaseRecord | None:
        """The lease as the held update left it (committed), or None when it did not land."""
        if done.rowcount != 1:
            session.rollback()
            return None
        record = _record(session.get(ControlPlaneLease, self.name, populate_existing=True))
        session.commit()
        return record

    def renew(self, me: str, epoch: int) -> LeaseRecord | None:
        """The renewed lease, or None when `me` no longer holds `epoch`."""
        with self.sessions() as session:
            with self._bounded(session):
                done = session.execute(self._held_update(me, epoch))
            return self._read_back(session, done)

    def raise_epoch(self, me: str, epoch: int, floor: int) -> LeaseRecord | None:
        """The lease under epoch `floor + 1` if `me` still holds `epoch`; None when anyone
        moved it on (a successor acquired: its epoch, not ours, is the one to raise)."""
        if floor < epoch:
            raise ValueError(f"floor {floor} is below the epoch {epoch} held")
        with self.sessions() as session:
            return self._read_back(session, session.execute(self._held_update(me, epoch, epoch=floor + 1)))

    def release(self, me: str, epoch: int) -> bool:
        with self.sessions() as session:
            done = session.execute(self._held_update(me, epoch, holder=None))
            session.commit()
            return done.rowcount == 1

    # ----------------------------------------------------------------- members

    def heartbeat(self, member_id: str, url: str, started_at: datetime) -> None:
        """Insert or refresh this process's row."""
        with self.sessions() as session:
            now = utcnow()
            done = session.execute(
                update(ControlPlaneMember)
                .where(ControlPlaneMember.id == member_id)
                .values(url=url, last_seen=now)
            )
            if done.rowcount == 0:
                session.add(ControlPlaneMember(id=member_id, url=url, started_at=started_at, last_seen=now))
            try:
                session.commit()
            except IntegrityError:
                session.rollback()  # a concurrent insert of the same id cannot happen (unique per process)

    def leave(self, member_id: str) -> None:
        with self.sessions() as session:
            session.execute(delete(ControlPlaneMember).where(ControlPlaneMember.id == member_id))
            session.commit()

    def members(self) -> list[Member]:
        with self.sessions() as session:
            rows = session.scalars(select(ControlPlaneMember).order_by(ControlPlaneMember.started_at))
            return [Member(r.id, r.url, r.started_at, r.last_seen) for r in rows]
