"""Test helpers: a real control plane process (`python -m control_plane`) on a free port,
and fresh databases (SQLite file or a new PostgreSQL database) to run it on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from control_plane.security.pki import ensure_webhook_master
from fleet_base.batch.webhook_signing import MASTER_FILE
from fleet_base.ports import free_port
from fleet_base.processes import stop_process
from tests.polling import wait_for_process

ROOT = Path(__file__).resolve().parents[2]
PG_ENV = "FLEET_TEST_POSTGRES_URL"
REQUIRE_PG_ENV = "FLEET_REQUIRE_POSTGRES"


# The leader's lease timing of a control plane a test kills and starts again: its successor
# waits out the dead instance's lease before it leads (the default 15 s is for real networks).
SHORT_LEASE_ENV = {
    "FLEET_LEADER_LEASE_S": "4",
    "FLEET_LEADER_RENEW_DEADLINE_S": "3",
    "FLEET_LEADER_RETRY_S": "0.5",
}


def postgres_admin_url() -> str:
    """FLEET_TEST_POSTGRES_URL, or skip (fail when FLEET_REQUIRE_POSTGRES=1) with why."""
    url = os.environ.get(PG_ENV, "")
    required = os.environ.get(REQUIRE_PG_ENV) == "1"
    reason = None
    if not url:
        reason = (
            f"{PG_ENV} is not set (start one with `bash scripts/postgres.sh` and export the URL it prints)"
        )
    else:
        import sqlalchemy as sa

        from control_plane.db.session import make_engine

        engine = make_engine(url, connect_args={"connect_timeout": 3})
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except Exception as err:
            reason = f"PostgreSQL at {PG_ENV} is unreachable: {str(err).splitlines()[0]}"
        finally:
            engine.dispose()
    if reason is not None:
        if required:
            pytest.fail(f"{REQUIRE_PG_ENV}=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return url


class PostgresDatabase:
    """A new, empty database on the test server, dropped (with its connections) on close."""

    def __init__(self, admin_url: str) -> None:
        from sqlalchemy.engine import make_url

        from control_plane.db.session import normalize_url

        self.name = f"fleet_t_{uuid.uuid4().hex[:10]}"
        base = make_url(normalize_url(admin_url))
        self.admin_url = base.render_as_string(hide_password=False)
        self.url = base.set(database=self.name).render_as_string(hide_password=False)
        self._exec(f'CREATE DATABASE "{self.name}"')

    def _exec(self, sql: str) -> None:
        import sqlalchemy as sa

        from control_plane.db.session import make_engine

        engine = make_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(sql))
        finally:
            engine.dispose()

    def drop(self) -> None:
        self._exec(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def fresh_database(kind: str, tmp: Path):
    """(url, cleanup) of an empty database of `kind` ('sqlite' or 'postgresql')."""
    if kind == "sqlite":
        return f"sqlite:///{tmp / 'fleet.db'}", lambda: None
    db = PostgresDatabase(postgres_admin_url())
    return db.url, db.drop


class ControlPlaneServer:
    """`python -m control_plane --port 0` with FLEET_HOME=home; NATS may be absent.
    `loops=False` (the default here) serves the API alone, so API tests see exactly
    what they wrote; pass loops=True for placement and publishing."""

    def __init__(
        self, home: Path, database_url: str, nats_url: str | None = None, *, loops: bool = False
    ) -> None:
        self.loops = loops
        self.home = Path(home)
        self.database_url = database_url
        self.nats_url = nats_url or f"nats://127.0.0.1:{free_port()}"  # nobody listens: fine
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.token = ""

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            FLEET_HOME=str(self.home),
            FLEET_DATABASE_URL=self.database_url,
            # as `fleetctl up` hands it over: keys are created with a webhook signing secret
            FLEET_WEBHOOK_MASTER=str(ensure_webhook_master(self.home / "pki" / MASTER_FILE)),
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        env.pop("FLEET_API_URL", None)
        env.pop("FLEET_TOKEN", None)
        return env

    def start(self, timeout: float = 60.0) -> ControlPlaneServer:
        self.home.mkdir(parents=True, exist_ok=True)
        api_file = self.home / "api-url"
        api_file.unlink(missing_ok=True)
        log = open(self.home / "control-plane.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane", "--port", "0", "--nats-url", self.nats_url]
            + ([] if self.loops else ["--no-loops"]),
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        try:
            self.url = wait_for_process(
                self.proc, lambda: self._healthy(api_file), timeout, "the control plane", self.log_tail,
                retry_errors=(OSError, httpx.HTTPError),
            )  # fmt: skip
        except RuntimeError:
            self.stop()
            raise
        self.token = (self.home / "admin-token").read_text().strip()
        return self

    def _healthy(self, api_file: Path) -> str:
        """The URL once the process wrote it and answers /healthz there; "" until then."""
        url = api_file.read_text().strip() if api_file.exists() else ""
        return url if url and httpx.get(f"{url}/healthz", timeout=1).status_code == 200 else ""

    def log_tail(self, lines: int = 40) -> str:
        path = self.home / "control-plane.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def client(self, token: str | None = None) -> httpx.Client:
        token = self.token if token is None else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group; SIGKILL if it lingers. Returns the exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        return stop_process(proc, timeout, group=True)

    def kill(self) -> None:
        """SIGKILL the process group and reap it: a fixture's teardown, where how the server
        stops is not under test (a graceful stop takes ~1 s; tests/control_plane/test_server.py
        checks it)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
