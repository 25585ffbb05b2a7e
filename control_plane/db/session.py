"""Engines and sessions for SQLite (default, under $FLEET_HOME) and PostgreSQL
(`postgresql+psycopg://`), and Alembic upgrades run from code.

SQLite gets WAL (the API and the control loops write concurrently), foreign keys on
(cascades) and a busy timeout, so a writer waits for the lock instead of failing.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

import control_plane

SQLITE_BUSY_TIMEOUT_MS = 15_000
# TCP keepalives, both ways: the driver notices a dead server, and the server a dead client
# (whose backend would otherwise keep its row locks for the kernel's 2 h default) in
# idle + interval * count = 5 + 2 * 3 = 11 s.
PG_KEEPALIVE_IDLE_S, PG_KEEPALIVE_INTERVAL_S, PG_KEEPALIVE_COUNT = 5, 2, 3


def normalize_url(url: str) -> str:
    """`postgresql://` and `postgres://` mean psycopg 3 (the installed driver)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def make_engine(url: str, *, idle_in_transaction_s: float | None = None, **kwargs) -> Engine:
    """`idle_in_transaction_s` (PostgreSQL): the server ends a session that sits that long
    inside a transaction (a paused or partitioned process holding row locks)."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    if parsed.get_backend_name() == "postgresql":
        kwargs["connect_args"] = {
            **_pg_connect_args(parsed, idle_in_transaction_s),
            **kwargs.get("connect_args", {}),
        }
    return create_engine(url, **kwargs)


def _pg_connect_args(parsed, idle_in_transaction_s: float | None) -> dict:
    args: dict = {
        "keepalives": 1,
        "keepalives_idle": PG_KEEPALIVE_IDLE_S,
        "keepalives_interval": PG_KEEPALIVE_INTERVAL_S,
        "keepalives_count": PG_KEEPALIVE_COUNT,
    }
    if "options" in parsed.query:
        return args  # the URL's own server options win
    options = [
        f"-c tcp_keepalives_idle={PG_KEEPALIVE_IDLE_S}",
        f"-c tcp_keepalives_interval={PG_KEEPALIVE_INTERVAL_S}",
        f"-c tcp_keepalives_count={PG_KEEPALIVE_COUNT}",
    ]
    if idle_in_transaction_s is not None:
        options.append(
            f"-c idle_in_transaction_session_timeout={max(1, round(idle_in_transaction_s * 1000))}"
        )
    args["options"] = " ".join(options)
    return args


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def begin_write(session: Session) -> None:
    """Start `session`'s transaction as a writer. On SQLite a transaction that reads and then
    writes fails at once with "database is locked" when another connection committed since
    its read (WAL cannot upgrade a stale snapshot, and the busy timeout does not apply), so
    a writer takes the write lock first (BEGIN IMMEDIATE: it waits its turn under the busy
    timeout instead). PostgreSQL locks rows, not the database: nothing to do there."""
    if session.get_bind().dialect.name != "sqlite":
        return
    conn = session.connection()
    if not conn.connection.dbapi_connection.in_transaction:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


# PostgreSQL error classes that say "not now" rather than "not this row": connection
# exceptions (08), serialization failure and deadlock (40001, 40P01), insufficient resources
# (53: a full disk, too many connections), lock not available (55P03), the server shutting
# down (57P01-57P03). SQLite says the same in words.
RETRYABLE_SQLSTATES = ("08", "40001", "40P01", "53", "55P03", "57P01", "57P02", "57P03")
SQLITE_UNAVAILABLE = (
    "database is locked",
    "database is busy",
    "database table is locked",
    "disk is full",
    "disk i/o error",
)


def unavailable(err: OperationalError) -> bool:
    """Whether `err` means the database could not be had (the connection lost, the lock not
    had within the busy or lock timeout, a full disk): the work is retried whole later, and
    nothing accepted is lost meanwhile. Any other `OperationalError` is about the statement,
    and retrying it would fail forever."""
    if err.connection_invalidated:
        return True
    state = getattr(err.orig, "sqlstate", None)
    if isinstance(state, str):
        return state.startswith(RETRYABLE_SQLSTATES)
    text = str(err.orig).lower()
    return any(words in text for words in SQLITE_UNAVAILABLE)


def make_sessions(url: str | Engine, *, idle_in_transaction_s: float | None = None) -> sessionmaker[Session]:
    engine = url if isinstance(url, Engine) else make_engine(url, idle_in_transaction_s=idle_in_transaction_s)
    return sessionmaker(engine, expire_on_commit=False)


# --------------------------------------------------------------------- Alembic


def migrations_dir() -> Path:
    """`migrations/` at the repository root, next to the package (editable installs)."""
    return Path(control_plane.__file__).resolve().parents[1] / "migrations"


def alembic_config(url: str):
    from alembic.config import Config

    root = migrations_dir().parent
    ini = root / "alembic.ini"
    cfg = Config(str(ini)) if ini.exists() else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # The revisions import their shared helpers as `migrations.batch`, with or without the ini.
    cfg.set_main_option("prepend_sys_path", str(root))
    # ConfigParser interpolation: a literal % in a password must be doubled.
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade_to_head(url: str, revision: str = "head") -> None:
    """Upgrade, one process at a time per database: control-plane instances starting together
    (two pods at first install) would otherwise both create the same tables, and all but one
    fail. Whoever comes second finds the database at head and does nothing."""
    from alembic import command

    with migration_lock(url):
        command.upgrade(alembic_config(url), revision)


# PostgreSQL advisory lock key of the upgrade: any fixed 64-bit number, the same in every process.
MIGRATION_LOCK_KEY = 0x666C656574_4D49


@contextlib.contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """An exclusive lock on the database's migrations: an advisory lock on PostgreSQL, a file
    lock beside a SQLite file (processes on one host), nothing for in-memory SQLite."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        engine = make_engine(url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                conn.commit()
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                    conn.commit()
        finally:
            engine.dispose()
    elif parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        path = Path(parsed.database).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.migrate-lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    else:
        yield


def downgrade(url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision(url: str = "sqlite://") -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()
