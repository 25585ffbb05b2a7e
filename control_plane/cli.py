"""`fleetctl`: the operator's CLI. A client of the admin API (deploy, ls, status, ...)
and a launcher of the other components as processes (`up`, `agent`, `engine`): it never
imports engine/ code, so the CLI stays free of torch.

Command groups live in `control_plane/commands/`; each module's `register(app)` adds
its commands here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import typer

app = typer.Typer(help="Fleet: self-hosted multi-cloud LLM inference.", no_args_is_help=True)


@app.command("version")
def show_version() -> None:
    """Print Fleet's version."""
    try:
        typer.echo(version("fleet"))
    except PackageNotFoundError:
        typer.echo("fleet (not installed as a package)")


@app.command("engine")
def run_engine(
    model: str = typer.Option("smollm2-135m", help="model alias, .gguf file or Hugging Face directory"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    extra: list[str] = typer.Argument(None, help="further `python -m engine.server` flags after --"),
) -> None:
    """Serve one engine replica in the foreground (`python -m engine.server`)."""
    cmd = [sys.executable, "-m", "engine.server", "--model", model, "--host", host, "--port", str(port)]
    cmd += list(extra or [])
    try:
        raise typer.Exit(subprocess.call(cmd, env=os.environ.copy()))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _register_command_groups() -> None:
    import importlib
    import pkgutil

    import control_plane.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"control_plane.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_command_groups()

if __name__ == "__main__":
    app()
