"""Retention: bounded-batch deletes, the cutoffs per table (usage never within the current
month), and one run over every table, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from control_plane.db import models as m
from control_plane.db.prune import prune_before
from control_plane.scheduled.retention import prune_all, retention_cutoffs
from control_plane.settings import Settings

NOW = datetime(2026, 12, 20, 12, 0, tzinfo=timezone.utc)
DAY = timedelta(days=1)


def _events(db, ages_days: list[float]) -> None:
    with db() as s:
        s.add_all(m.Event(kind="t", message=str(a), at=NOW - a * DAY) for a in ages_days)
        s.commit()


def _count(db, model) -> int:
    with db() as s:
        return s.scalar(select(func.count()).select_from(model))


@pytest.mark.parametrize(
    ("old", "new", "batch"),
    [
        (0, 3, 2),  # nothing to delete
        (7, 2, 1),  # one row per transaction
        (6, 2, 3),  # an exact multiple of the batch: one more (empty) round ends it
        (7, 2, 3),  # a partial last batch
        (5, 0, 5000),  # everything old, one batch
    ],
)
def test_prune_before_deletes_exactly_the_old_rows_whatever_the_batch(db, old, new, batch) -> None:
    _events(db, [10.0 + i for i in range(old)] + [1.0 + i / 10 for i in range(new)])
    assert prune_before(db, m.Event, NOW - 5 * DAY, batch=batch) == old
    with db() as s:
        assert all(e.at >= NOW - 5 * DAY for e in s.scalars(select(m.Event)))
    assert _count(db, m.Event) == new


def test_a_row_exactly_at_the_cutoff_is_kept(db) -> None:
    _events(db, [5.0, 5.0 + 1e-5])
    assert prune_before(db, m.Event, NOW - 5 * DAY) == 1
    assert _count(db, m.Event) == 1


def test_batch_must_be_positive(db) -> None:
    with pytest.raises(ValueError):
        prune_before(db, m.Event, NOW, batch=0)


@pytest.mark.parametrize(
    ("now", "usage_days", "usage_cutoff"),
    [
        # retention longer than the month so far: the retention decides
        (NOW, 90, NOW - 90 * DAY),
        # retention shorter than the month so far: the month's first instant decides
        (NOW, 1, datetime(2026, 12, 1, tzinfo=timezone.utc)),
        (NOW, 19.5, datetime(2026, 12, 1, tzinfo=timezone.utc)),
        (NOW, 19.4, datetime(2026, 12, 1, tzinfo=timezone.utc)),
        # the first second of a month: the retention decides again
        (
            datetime(2027, 1, 1, 0, 0, 1, tzinfo=timezone.utc),
            0.5,
            datetime(2026, 12, 31, 12, 0, 1, tzinfo=timezone.utc),
        ),
        (datetime(2027, 3, 1, 6, tzinfo=timezone.utc), 3, datetime(2027, 2, 26, 6, tzinfo=timezone.utc)),
    ],
)
def test_usage_cutoff_never_reaches_into_the_current_month(now, usage_days, usage_cutoff) -> None:
    settings = Settings(usage_retention_days=usage_days, retention_events_days=7, retention_audit_days=400)
    cutoffs = retention_cutoffs(settings, now)
    assert cutoffs["usage"] == usage_cutoff
    assert cutoffs["events"] == now - 7 * DAY
    assert cutoffs["audit"] == now - 400 * DAY


def test_one_run_prunes_each_table_by_its_own_age(db) -> None:
    settings = Settings(retention_events_days=30, retention_audit_days=365, usage_retention_days=2)
    _events(db, [1, 29, 31, 400])
    with db() as s:
        s.add_all(
            m.AuditRecord(actor="a", action="x", resource_type="key", resource_id=str(a), at=NOW - a * DAY)
            for a in (1, 31, 364, 366, 1000)
        )
        s.add_all(
            m.UsageRecord(at=NOW - a * DAY, cluster="c", key_id="k", deployment="d", record_id=f"r{a}")
            for a in (1, 5, 19, 21, 60)  # 19 days ago is in this month (the 1st): budgets read it
        )
        s.commit()
    pruned = prune_all(db, settings, NOW)
    assert pruned.deleted == {"events": 2, "audit": 2, "usage": 2}
    with db() as s:
        assert sorted(r.record_id for r in s.scalars(select(m.UsageRecord))) == ["r1", "r19", "r5"]
        assert sorted(r.resource_id for r in s.scalars(select(m.AuditRecord))) == ["1", "31", "364"]
    assert "events: 2 deleted" in str(pruned)
