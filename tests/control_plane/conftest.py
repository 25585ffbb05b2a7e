"""Control plane fixtures: a database of each kind (SQLite, PostgreSQL) and a real server
process on it. PostgreSQL comes from FLEET_TEST_POSTGRES_URL (scripts/postgres.sh
starts one); without it those tests skip, unless FLEET_REQUIRE_POSTGRES=1 (CI)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from control_plane.db.session import make_sessions, upgrade_to_head
from tests.control_plane.cp_server import ControlPlaneServer, fresh_database

DB_KINDS = ["sqlite", "postgresql"]


@pytest.fixture(params=DB_KINDS)
def db_url(request, tmp_path):
    """An empty database of each kind, for one test."""
    url, cleanup = fresh_database(request.param, tmp_path)
    yield url
    cleanup()


@pytest.fixture(scope="module", params=DB_KINDS)
def cp_server(request, tmp_path_factory):
    """One control plane process per module and database kind (tests use unique names)."""
    tmp = tmp_path_factory.mktemp(f"cp-{request.param}")
    url, cleanup = fresh_database(request.param, tmp)
    server = ControlPlaneServer(tmp / "home", url)
    try:
        server.start()
        yield server
    finally:
        server.kill()
        cleanup()


@pytest.fixture(scope="module")
def sqlite_server(tmp_path_factory):
    """One control plane process per module on a SQLite file (the CLI tests' server)."""
    tmp = tmp_path_factory.mktemp("cp-sqlite")
    server = ControlPlaneServer(tmp / "home", f"sqlite:///{tmp / 'fleet.db'}").start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def admin(cp_server):
    """An httpx client with the server's admin token (shared: creating clients is not free)."""
    with cp_server.client() as client:
        yield client


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory) -> Path:
    """A SQLite file migrated to head once per session: the template `sessions` copies
    (running every migration for each test cost far more than the test itself)."""
    path = tmp_path_factory.mktemp("migrated") / "fleet.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


def copy_sqlite(source: Path, target: Path) -> None:
    """A page-for-page copy through SQLite's backup API (it reads through the WAL)."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


@pytest.fixture
def sessions(tmp_path, migrated_sqlite):
    """A session factory on a fresh SQLite database migrated to head (a copy of the
    session's template); a module's own `sessions` fixture may take this one and add its fleet."""
    path = tmp_path / "fleet.db"
    copy_sqlite(migrated_sqlite, path)
    factory = make_sessions(f"sqlite:///{path}")
    yield factory
    factory.kw["bind"].dispose()
