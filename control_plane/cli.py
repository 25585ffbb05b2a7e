"""`fleetctl`: the operator's CLI. For now it launches a single engine replica; the control
plane's commands (deploy, ls, status, ...) join as the control plane lands.

It starts other components as processes (never imports engine/ or agent/), so the CLI
stays free of torch.
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


if __name__ == "__main__":
    app()
