"""Alembic on both databases: empty -> head creates every table the models declare (and
nothing differs from the models), head -> base drops them, and back up again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from control_plane.db import session as dbs
from control_plane.db.models import Base
from tests.control_plane.cp_server import ROOT

TABLES = {
    "deployments",
    "deployment_versions",
    "clusters",
    "capacity_pools",
    "replica_assignments",
    "api_keys",
    "events",
    "audit_records",
    "rollouts",
    "usage_records",
    "replica_intervals",
    "team_budgets",
    "nodes",
    "node_faults",
    "control_plane_lease",
    "control_plane_members",
    "autoscaler_states",
    "pipelines",
}


def _tables(url: str) -> set[str]:
    engine = dbs.make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_from_empty_to_head_and_down_to_base(db_url):
    assert _tables(db_url) == set()
    assert dbs.current_revision(db_url) is None

    dbs.upgrade_to_head(db_url)
    assert _tables(db_url) == TABLES == set(Base.metadata.tables)
    assert dbs.current_revision(db_url) == dbs.head_revision(db_url)
    engine = dbs.make_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == [], f"models and migrations disagree: {diff}"
        inspector = sa.inspect(engine)
        fks = {fk["referred_table"] for fk in inspector.get_foreign_keys("replica_assignments")}
        assert fks == {"deployments", "clusters"}
        assert any(
            u["column_names"] == ["deployment_id", "version"]
            for u in inspector.get_unique_constraints("deployment_versions")
        )
    finally:
        engine.dispose()

    dbs.downgrade(db_url, "base")
    assert _tables(db_url) == set()
    assert dbs.current_revision(db_url) is None

    dbs.upgrade_to_head(db_url)  # and up again: downgrade left nothing behind
    assert _tables(db_url) == TABLES


def test_fleetctl_db_commands(tmp_path):
    env = {**os.environ, "FLEET_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("FLEET_DATABASE_URL", None)

    def fleetctl(*args: str) -> dict:
        res = subprocess.run(
            [sys.executable, "-m", "control_plane.cli", "db", *args, "-o", "json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    head = dbs.head_revision()
    assert fleetctl("current") == {"current": None, "head": head, "up_to_date": False}
    assert fleetctl("upgrade") == {"current": head, "head": head, "up_to_date": True}
    assert _tables(f"sqlite:///{tmp_path / 'fleet.db'}") == TABLES
    assert fleetctl("downgrade", "base")["current"] is None
    assert _tables(f"sqlite:///{tmp_path / 'fleet.db'}") == set()
    bad = subprocess.run(
        [sys.executable, "-m", "control_plane.cli", "db", "upgrade", "nonexistent-rev"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "error:" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_0019_deployment_engine_keeps_versions_and_defaults_them_to_fleet(db_url):
    dbs.upgrade_to_head(db_url, "0018")
    engine = dbs.make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO deployments (name, replicas, variant_mix, current_version, created_at, updated_at) VALUES ('chat', 1, '{}', 1, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))  # fmt: skip
            dep_id = conn.execute(sa.text("SELECT id FROM deployments WHERE name = 'chat'")).scalar_one()
            conn.execute(
                sa.text(
                    "INSERT INTO deployment_versions (deployment_id, version, model, engine_args, gpu_models, "
                    "gpu_count, gpu_memory_gb, min_replicas, max_replicas, autoscale_window_s, "
                    "scale_down_delay_s, target_concurrency, scale_to_zero, regions, min_regions, "
                    "standby_regions, created_at) VALUES (:d, 1, 'smollm2-135m', '{}', '[]', 1, 0, 1, 1, 60, "
                    "300, 8, false, '[]', 1, '[]', CURRENT_TIMESTAMP)"
                ),
                {"d": dep_id},
            )
        dbs.upgrade_to_head(db_url)
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT model, engine FROM deployment_versions")).all()
        assert [tuple(r) for r in rows] == [("smollm2-135m", "fleet")]
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE deployment_versions SET engine = 'llama.cpp'"))
        dbs.downgrade(db_url, "0018")
        engine.dispose()
        columns = {c["name"] for c in sa.inspect(engine).get_columns("deployment_versions")}
        assert "engine" not in columns and "model" in columns
        with engine.connect() as conn:
            assert (
                conn.execute(sa.text("SELECT model FROM deployment_versions")).scalar_one() == "smollm2-135m"
            )
    finally:
        engine.dispose()


def test_0020_scale_down_delay_nullable_nulls_the_old_default_and_keeps_set_values(db_url):
    dbs.upgrade_to_head(db_url, "0019")
    engine = dbs.make_engine(db_url)
    version = sa.text(
        "INSERT INTO deployment_versions (deployment_id, version, model, engine_args, gpu_models, gpu_count, "
        "gpu_memory_gb, min_replicas, max_replicas, autoscale_window_s, scale_down_delay_s, target_concurrency, "
        "scale_to_zero, regions, min_regions, standby_regions, created_at) VALUES (:d, :v, 'm', '{}', '[]', 1, 0, "
        "1, 4, 60, :delay, 8, false, '[]', 1, '[]', CURRENT_TIMESTAMP)"
    )
    delays = lambda conn: [r[0] for r in conn.execute(sa.text("SELECT scale_down_delay_s FROM deployment_versions ORDER BY version"))]  # noqa: E731  # fmt: skip
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO deployments (name, replicas, variant_mix, current_version, created_at, updated_at) VALUES ('chat', 1, '{}', 2, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))  # fmt: skip
            dep_id = conn.execute(sa.text("SELECT id FROM deployments WHERE name = 'chat'")).scalar_one()
            conn.execute(version, {"d": dep_id, "v": 1, "delay": 300.0})
            conn.execute(version, {"d": dep_id, "v": 2, "delay": 45.0})
        dbs.upgrade_to_head(db_url)
        with engine.begin() as conn:
            assert delays(conn) == [None, 45.0]
            conn.execute(version, {"d": dep_id, "v": 3, "delay": None})  # null is allowed now
        dbs.downgrade(db_url, "0019")
        engine.dispose()
        with engine.connect() as conn:
            assert delays(conn) == [300.0, 45.0, 300.0]
        column = next(
            c
            for c in sa.inspect(engine).get_columns("deployment_versions")
            if c["name"] == "scale_down_delay_s"
        )
        assert column["nullable"] is False
    finally:
        engine.dispose()
