"""`fleetctl control-plane`: run the control plane in the foreground."""

from __future__ import annotations

import typer


def control_plane(
    host: str = typer.Option(None, help="listen address (default 127.0.0.1)"),
    port: int = typer.Option(None, help="listen port (default 7070; 0: any free port)"),
    nats_url: str = typer.Option(None, help="NATS server (default $FLEET_NATS_URL or nats://127.0.0.1:4222)"),
    database_url: str = typer.Option(None, help="default $FLEET_DATABASE_URL or SQLite under $FLEET_HOME"),
    loops: bool = typer.Option(True, "--loops/--no-loops", help="run the control loops (off: the API only)"),
) -> None:
    """Run the control plane (admin API, database, control loops) in the foreground."""
    from control_plane.server import configure_logging, run
    from control_plane.settings import Settings

    configure_logging()
    settings = Settings.from_env(host=host, port=port, nats_url=nats_url, database_url=database_url)
    raise typer.Exit(run(settings, loops=loops))


def register(app: typer.Typer) -> None:
    app.command("control-plane")(control_plane)
