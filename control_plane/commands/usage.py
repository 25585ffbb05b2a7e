"""`fleetctl usage`: tokens and estimated cost per key and deployment (GET /v1/usage)."""

from __future__ import annotations

import typer

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, emit, emit_json, show

USAGE_COLUMNS = {
    "key": "key_id",
    "deployment": "deployment",
    "requests": "requests",
    "errors": "errors",
    "prompt": "prompt_tokens",
    "completion": "completion_tokens",
    "tokens": "total_tokens",
    "est. cost": "estimated_cost",
    "processed in": "jurisdictions",
}


def usage(
    key: str = typer.Option(None, "--key", help="one key's id"),
    deployment: str = typer.Option(None, "--deployment", help="one deployment"),
    since: str = typer.Option("1h", "--since", help="90s, 30m, 1h, 7d or an ISO 8601 time"),
    region: str = typer.Option(None, "--region", help="only requests processed in this region"),
    jurisdiction: str = typer.Option(
        None, "--jurisdiction", help="only requests processed in this jurisdiction"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Token usage and estimated cost per key and deployment, from the gateways' usage records."""
    report = call(
        lambda c: c.get(
            "/v1/usage",
            key=key,
            deployment=deployment,
            since=since,
            region=region,
            jurisdiction=jurisdiction,
        )
    )
    if output == OutputFormat.json:
        emit_json(report)
        return
    show(report["items"], output, USAGE_COLUMNS, title=f"usage since {report['since'][:19]}Z")
    console.print(
        f"total: {report['total_tokens']} tokens, estimated cost {report['estimated_cost']:.4f}",
        highlight=False,
    )
    if report.get("batch"):  # batch lines and async requests: already in the rows above
        emit(
            report["batch"],
            output,
            ["key_id", "deployment", "requests", "errors", "prompt_tokens", "completion_tokens"],
            title="batch usage (batch lines and async requests, included above)",
        )
    if report.get("shadow"):  # a rollout's shadow copies: charged to no key
        emit(
            report["shadow"],
            output,
            ["deployment", "version", "requests", "errors", "prompt_tokens", "completion_tokens"],
            title="shadow usage (copies, charged to no key)",
        )


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)
