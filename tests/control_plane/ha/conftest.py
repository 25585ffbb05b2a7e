"""A migrated database of each kind per module; tests isolate by a unique lease name."""

from __future__ import annotations

import itertools

import pytest

from control_plane.db.session import make_sessions, upgrade_to_head
from tests.control_plane.conftest import DB_KINDS
from tests.control_plane.cp_server import fresh_database

_names = itertools.count()


@pytest.fixture(scope="module", params=DB_KINDS)
def db_sessions(request, tmp_path_factory):
    url, cleanup = fresh_database(request.param, tmp_path_factory.mktemp(f"ha-{request.param}"))
    upgrade_to_head(url)
    factory = make_sessions(url)
    factory.kind = request.param
    yield factory
    factory.kw["bind"].dispose()
    cleanup()


@pytest.fixture
def lease_name() -> str:
    return f"lease-{next(_names)}"
