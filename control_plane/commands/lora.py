"""`fleetctl lora ls|add|rm`: a deployment's LoRA adapters (name -> model URI). Adding or
removing one never restarts replicas: agents load and unload it on the running ones."""

from __future__ import annotations

import typer

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, emit, fail

lora_app = typer.Typer(help="A deployment's LoRA adapters.", no_args_is_help=True)
COLUMNS = ("name", "uri")


def adapter_pairs(items: list[str]) -> list[dict[str, str]]:
    """['NAME=URI', ...] -> [{"name", "uri"}, ...]; a malformed item is a clear error."""
    out = []
    for item in items:
        name, sep, uri = item.partition("=")
        if not sep or not name.strip() or not uri.strip():
            fail(f"--lora {item!r}: expected NAME=URI")
        out.append({"name": name.strip(), "uri": uri.strip()})
    return out


def _show(view: dict, output: OutputFormat) -> None:
    if output == OutputFormat.json:
        emit(view, output)
        return
    title = f"{view['deployment']}: LoRA adapters (max {view['max_adapters']} per replica)"
    emit(view["adapters"], output, COLUMNS, title=title)


@lora_app.command("ls")
def ls(deployment: str = typer.Argument(..., help="deployment name"), output: OutputFormat = OUTPUT_OPTION):
    """List a deployment's adapters."""
    _show(call(lambda c: c.get(f"/v1/deployments/{deployment}/adapters")), output)


@lora_app.command("add")
def add(
    deployment: str = typer.Argument(..., help="deployment name"),
    adapter: str = typer.Argument(..., help="NAME=URI of the adapter's PEFT files"),
    output: OutputFormat = OUTPUT_OPTION,
):
    """Add an adapter; clients then request it as `"model": NAME`."""
    body = adapter_pairs([adapter])[0]
    _show(call(lambda c: c.post(f"/v1/deployments/{deployment}/adapters", body)), output)


@lora_app.command("rm")
def rm(
    deployment: str = typer.Argument(..., help="deployment name"),
    name: str = typer.Argument(..., help="adapter name"),
    output: OutputFormat = OUTPUT_OPTION,
):
    """Remove an adapter (replicas unload it)."""
    _show(call(lambda c: c.delete(f"/v1/deployments/{deployment}/adapters/{name}")), output)


def register(app: typer.Typer) -> None:
    app.add_typer(lora_app, name="lora")
