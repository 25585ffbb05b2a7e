"""Stale state: nodes no heartbeat has reported for `stale_node_days` and control-plane
members not seen for `stale_member_s` are forgotten, the rest kept; a new kind of stale
row is one more `Expiry`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from control_plane.db import models as m
from control_plane.scheduled.stale_state import EXPIRIES, Expiry, expire_all
from control_plane.settings import Settings

NOW = datetime(2026, 12, 20, tzinfo=timezone.utc)
DAY = timedelta(days=1)


@pytest.mark.parametrize(
    ("days", "ages", "kept"),
    [
        (7, [0, 1, 6.9, 7.1, 30], ["n0", "n1", "n6.9"]),
        (1, [0.5, 2, 3], ["n0.5"]),
        (100, [0, 99, 200], ["n0", "n99"]),
    ],
)
def test_nodes_not_reported_for_long_are_forgotten(db, days, ages, kept) -> None:
    with db() as s:
        s.add_all(m.Node(cluster="east", node=f"n{a}", updated_at=NOW - a * DAY) for a in ages)
        s.commit()
    expired = expire_all(db, Settings(stale_node_days=days), NOW)
    assert expired.deleted == {"nodes": len(ages) - len(kept), "members": 0}
    with db() as s:
        assert sorted(s.scalars(select(m.Node.node))) == sorted(kept)


def test_another_kind_of_stale_row_is_one_more_expiry(db) -> None:
    with db() as s:
        s.add_all(m.Event(kind="t", at=NOW - a * DAY) for a in (1, 3))
        s.add(m.Node(cluster="east", node="old", updated_at=NOW - 30 * DAY))
        s.commit()
    extra = Expiry("events", m.Event, "at", lambda s: 2 * DAY)
    expired = expire_all(db, Settings(), NOW, (*EXPIRIES, extra))
    assert expired.deleted == {"nodes": 1, "members": 0, "events": 1}


@pytest.mark.parametrize(
    ("unseen_for_s", "ages_s", "kept"),
    [
        (3600, [1, 10, 3599, 3601, 86400], ["m1", "m10", "m3599"]),
        (60, [2, 61], ["m2"]),
    ],
)
def test_members_not_seen_for_long_drop_out(db, unseen_for_s, ages_s, kept) -> None:
    with db() as s:
        s.add_all(
            m.ControlPlaneMember(id=f"m{a}", url=f"http://h{a}", started_at=NOW - timedelta(days=2),
                                 last_seen=NOW - timedelta(seconds=a))
            for a in ages_s
        )  # fmt: skip
        s.commit()
    expired = expire_all(db, Settings(stale_member_s=unseen_for_s), NOW)
    assert expired.deleted["members"] == len(ages_s) - len(kept)
    with db() as s:
        assert sorted(s.scalars(select(m.ControlPlaneMember.id))) == sorted(kept)
