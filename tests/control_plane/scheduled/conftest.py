"""A migrated database of each kind (SQLite, PostgreSQL when FLEET_TEST_POSTGRES_URL is
set) per module; each test starts from empty tables (`db`)."""

from __future__ import annotations

import pytest
from sqlalchemy import delete

from control_plane.db import models as m
from control_plane.db.session import make_sessions, upgrade_to_head
from tests.control_plane.conftest import DB_KINDS
from tests.control_plane.cp_server import fresh_database

TABLES = (
    m.Event, m.AuditRecord, m.UsageRecord, m.Node, m.TeamBudget, m.ApiKey, m.ControlPlaneLease, m.ControlPlaneMember,
)  # fmt: skip


@pytest.fixture(scope="module", params=DB_KINDS)
def migrated(request, tmp_path_factory):
    url, cleanup = fresh_database(request.param, tmp_path_factory.mktemp(f"sched-{request.param}"))
    upgrade_to_head(url)
    factory = make_sessions(url)
    yield factory
    factory.kw["bind"].dispose()
    cleanup()


@pytest.fixture
def db(migrated):
    with migrated() as session:
        for table in TABLES:
            session.execute(delete(table))
        session.commit()
    return migrated
