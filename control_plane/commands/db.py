"""`fleetctl db upgrade|downgrade|current`: Alembic migrations of the control plane's
database ($FLEET_DATABASE_URL, else SQLite under $FLEET_HOME)."""

from __future__ import annotations

import typer

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, emit, fail

db_app = typer.Typer(help="Database migrations (Alembic).", no_args_is_help=True)


def _url(database_url: str | None) -> str:
    from control_plane.settings import Settings

    return Settings.from_env(database_url=database_url).db_url


DB_URL = typer.Option(None, "--database-url", help="default $FLEET_DATABASE_URL or SQLite under $FLEET_HOME")


def _state(url: str) -> dict:
    from control_plane.db.session import current_revision, head_revision

    current = current_revision(url)
    head = head_revision(url)
    return {"current": current, "head": head, "up_to_date": current == head}


def _run(action, url: str, revision: str, output: OutputFormat) -> None:
    try:
        action(url, revision)
        state = _state(url)
    except Exception as err:  # alembic/sqlalchemy raise many types; report one line
        fail(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    emit(state, output)


@db_app.command("upgrade")
def upgrade(
    revision: str = typer.Argument("head", help="target revision"),
    database_url: str = DB_URL,
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Upgrade the schema (to head by default)."""
    from control_plane.db.session import upgrade_to_head

    _run(upgrade_to_head, _url(database_url), revision, output)


@db_app.command("downgrade")
def downgrade(
    revision: str = typer.Argument("-1", help="target revision ('base' drops everything)"),
    database_url: str = DB_URL,
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Downgrade the schema (one step by default)."""
    from control_plane.db.session import downgrade as do_downgrade

    _run(do_downgrade, _url(database_url), revision, output)


@db_app.command("current")
def current(database_url: str = DB_URL, output: OutputFormat = OUTPUT_OPTION) -> None:
    """Show the database's revision and the latest one."""
    try:
        state = _state(_url(database_url))
    except Exception as err:
        fail(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    emit(state, output)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
