"""Alembic environment: the URL from the Alembic config (set by
control_plane.db.session.alembic_config) or else from Settings (FLEET_DATABASE_URL,
$FLEET_HOME/fleet.db). SQLite runs in batch mode so ALTERs work there too."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from control_plane.db.models import Base, UTCDateTime
from control_plane.db.session import make_engine, normalize_url
from control_plane.settings import Settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return normalize_url(config.get_main_option("sqlalchemy.url") or Settings.from_env().db_url)


def render_item(type_: str, obj, autogen_context):
    """Render our UTCDateTime as a plain DateTime(timezone=True): migrations must not
    import the models (they change; migrations must not)."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def run_migrations_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
