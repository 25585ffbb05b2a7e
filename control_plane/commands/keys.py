"""`fleetctl keys`: API keys through the admin API: create (the secret and the webhook
signing secret are shown once), ls, update (name, quotas, residency, team), revoke, and
webhook-secret (rotate the webhook signing secret, shown once)."""

from __future__ import annotations

from typing import Any

import typer

from control_plane.commands.output import (
    OUTPUT_OPTION,
    OutputFormat,
    call,
    console,
    done,
    emit_json,
    fail,
    show,
)
from control_plane.commands.residency import RESIDENCY_HELP, residency_flag

keys_app = typer.Typer(
    help="API keys: create (the secret is shown once), ls, update, revoke.", no_args_is_help=True
)

KEY_COLUMNS = {
    "key_id": "key_id",
    "name": "name",
    "scopes": "scopes",
    "deployments": "deployments",
    "quotas": "quotas",
    "residency": "residency",
    "team": "team",
    "created": "created_at",
    "revoked": "revoked",
}

DEPLOYMENT_LIMIT_HELP = "DEPLOYMENT:FIELD=N[,FIELD=N] with FIELD tpm, rpm or tpd (repeatable)"
LIMIT_FIELDS = {"tpm": "tokens_per_minute", "rpm": "requests_per_minute", "tpd": "tokens_per_day"}


@keys_app.command("create")
def keys_create(
    name: str = typer.Argument(..., help="a label for the key"),
    scope: list[str] = typer.Option(None, "--scope", help="inference (default), read or admin (repeatable)"),
    deployment: list[str] = typer.Option(
        None, "--deployment", help="allowed deployment (repeatable; none: all)"
    ),
    tokens_per_minute: int = typer.Option(None, "--tokens-per-minute"),
    requests_per_minute: int = typer.Option(None, "--requests-per-minute"),
    max_concurrent: int = typer.Option(None, "--max-concurrent"),
    priority: int = typer.Option(None, "--priority", help="-10..10; higher is served first"),
    tokens_per_day: int = typer.Option(None, "--tokens-per-day"),
    priority_class: str = typer.Option(None, "--priority-class", help="e.g. interactive, standard, batch"),
    deployment_limit: list[str] = typer.Option(None, "--deployment-limit", help=DEPLOYMENT_LIMIT_HELP),
    residency: str = typer.Option(None, "--residency", help=RESIDENCY_HELP),
    team: str = typer.Option(None, "--team", help="the team charged for the key's usage (fleetctl cost)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Create an API key; the secret (`key`) is printed once and never again."""
    quotas = {
        "tokens_per_minute": tokens_per_minute,
        "requests_per_minute": requests_per_minute,
        "max_concurrent": max_concurrent,
        "priority": priority,
        "tokens_per_day": tokens_per_day,
        "priority_class": priority_class,
    }
    body: dict[str, Any] = {"name": name, "quotas": {k: v for k, v in quotas.items() if v is not None}}
    if deployment_limit:
        body["quotas"]["deployments"] = parse_deployment_limits(deployment_limit)
    if scope:
        body["scopes"] = list(scope)
    if deployment:
        body["deployments"] = list(deployment)
    if residency is not None:
        body["residency"] = residency_flag(residency)
    if team is not None:
        body["team"] = team
    row = call(lambda c: c.post("/v1/keys", body))
    show(row, output, KEY_COLUMNS)
    if output != OutputFormat.json:
        console.print(f"key (shown once): [bold]{row['key']}[/bold]", highlight=False, soft_wrap=True)
        if row.get("webhook_secret"):
            console.print(
                f"webhook signing secret (shown once): [bold]{row['webhook_secret']}[/bold]",
                highlight=False,
                soft_wrap=True,
            )


@keys_app.command("webhook-secret")
def keys_webhook_secret(
    key_id: str = typer.Argument(..., help="the key's id"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Rotate the key's webhook signing secret; the new one is printed once (the old one
    stops verifying when gateways next receive the key set)."""
    row = call(lambda c: c.post(f"/v1/keys/{key_id}/webhook-secret", {}))
    if output == OutputFormat.json:
        emit_json(row)
        return
    console.print(
        f"webhook signing secret of {key_id} (version {row['webhook_secret_version']}, shown once): "
        f"[bold]{row['webhook_secret']}[/bold]",
        highlight=False,
        soft_wrap=True,
    )


@keys_app.command("ls")
def keys_ls(
    all_keys: bool = typer.Option(True, "--all/--active", help="include revoked keys"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """List API keys (never their secrets)."""
    rows = call(lambda c: c.items("/v1/keys", include_revoked=str(all_keys).lower()))
    show(rows, output, KEY_COLUMNS, title="API keys")


def parse_deployment_limits(specs: list[str]) -> dict[str, dict[str, int]]:
    """["tiny:tpm=1000,rpm=10"] -> {"tiny": {"tokens_per_minute": 1000, "requests_per_minute": 10}}."""
    out: dict[str, dict[str, int]] = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        limits: dict[str, int] = {}
        for part in filter(None, rest.split(",")):
            field, _, value = part.partition("=")
            if field not in LIMIT_FIELDS or not value.isdigit():
                fail(f"--deployment-limit {spec!r}: expected {DEPLOYMENT_LIMIT_HELP}")
            limits[LIMIT_FIELDS[field]] = int(value)
        if not name or not limits:
            fail(f"--deployment-limit {spec!r}: expected {DEPLOYMENT_LIMIT_HELP}")
        out[name] = limits
    return out


@keys_app.command("update")
def keys_update(
    key_id: str = typer.Argument(..., help="the key's id"),
    name: str = typer.Option(None, "--name"),
    tokens_per_minute: int = typer.Option(None, "--tokens-per-minute"),
    requests_per_minute: int = typer.Option(None, "--requests-per-minute"),
    tokens_per_day: int = typer.Option(None, "--tokens-per-day"),
    max_concurrent: int = typer.Option(None, "--max-concurrent"),
    priority: int = typer.Option(None, "--priority", help="-10..10"),
    priority_class: str = typer.Option(None, "--priority-class", help="e.g. interactive, standard, batch"),
    deployment_limit: list[str] = typer.Option(None, "--deployment-limit", help=DEPLOYMENT_LIMIT_HELP),
    residency: str = typer.Option(None, "--residency", help=RESIDENCY_HELP),
    team: str = typer.Option(None, "--team", help="the team charged for the key's usage"),
    clear: list[str] = typer.Option(
        None,
        "--clear",
        help="remove a limit (tokens_per_minute, requests_per_minute, tokens_per_day, ...), residency or team",
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Change a key's name, quotas, residency or team (PATCH /v1/keys/{id}); gateways apply it
    within seconds."""
    quotas: dict[str, Any] = {
        k: v
        for k, v in {
            "tokens_per_minute": tokens_per_minute,
            "requests_per_minute": requests_per_minute,
            "tokens_per_day": tokens_per_day,
            "max_concurrent": max_concurrent,
            "priority": priority,
            "priority_class": priority_class,
        }.items()
        if v is not None
    }
    if deployment_limit:
        quotas["deployments"] = parse_deployment_limits(deployment_limit)
    body: dict[str, Any] = {}
    for field in clear or []:
        if field in ("residency", "team"):
            body[field] = None
        else:
            quotas[field] = {} if field == "deployments" else None
    if residency is not None:
        body["residency"] = residency_flag(residency)
    if team is not None:
        body["team"] = team
    if name is not None:
        body["name"] = name
    if quotas:
        body["quotas"] = quotas
    if not body:
        fail("nothing to change: give --name, a limit, --residency, --team, or --clear")
    row = call(lambda c: c.patch(f"/v1/keys/{key_id}", body))
    show(row, output, KEY_COLUMNS)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="the key's id"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Revoke an API key."""
    row = call(lambda c: c.delete(f"/v1/keys/{key_id}"))
    done(row, output, f"revoked {row['key_id']} ({row['name']})")
