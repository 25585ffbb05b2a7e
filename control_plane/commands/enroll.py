"""`fleetctl clusters enroll NAME`: how a new (remote) cluster joins a secured fleet.

Run on the operator's machine, next to the fleet CA (`$FLEET_HOME/pki`): issues the
cluster's certificates and replica token, adds its NATS users (and reloads a local
nats-server), records the cluster and its peer gateway URL with the control plane, and
writes the bundle the cluster needs into `--out` (mode 0600), with a `cluster.yaml`
`security:` section pointing at it. The CA key never leaves this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, console, emit_json, fail
from control_plane.commands.residency import JURISDICTION_HELP, jurisdiction_flag
from control_plane.commands.resources import clusters_app
from control_plane.settings import fleet_home
from fleet_base.domain import is_cluster_id

if TYPE_CHECKING:
    from control_plane.security.enroll import NatsListen


def enroll(
    name: str = typer.Argument(..., help="cluster id (lowercase letters, digits, dashes)"),
    gateway_url: str = typer.Option(
        "", "--gateway-url", help="the cluster gateway's peer URL (https://...) other gateways forward to"
    ),
    host: list[str] = typer.Option(
        [], "--host", help="DNS name or IP its gateway and replicas serve under (repeatable)"
    ),
    region: str = typer.Option("", "--region"),
    jurisdiction: str = typer.Option("", "--jurisdiction", help=JURISDICTION_HELP),
    out: Path = typer.Option(None, "--out", help="write the bundle here (default ./NAME-credentials)"),
    register: bool = typer.Option(True, "--register/--no-register", help="record it with the control plane"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Issue a cluster's credentials bundle and register it (how a second region joins)."""
    from control_plane.security.enroll import Enrolment  # the crypto stack, only when enrolling
    from control_plane.security.pki import write_private

    if not is_cluster_id(name):
        fail(f"cluster name {name!r}: use lowercase letters, digits and dashes")
    if gateway_url and not gateway_url.startswith("https://"):
        fail("--gateway-url must be https:// (peers require TLS)")
    jurisdiction = jurisdiction_flag(jurisdiction)
    enrolment = Enrolment(fleet_home())
    hosts = ["localhost", "127.0.0.1", "::1", *host]
    creds = enrolment.enroll(name, hosts)
    if register:
        _register(name, gateway_url, region, jurisdiction)
    files = enrolment.bundle(name, creds)
    target = (out or Path.cwd() / f"{name}-credentials").expanduser().resolve()
    for file_name, text in files.items():
        write_private(target / file_name, text.encode())
    listen = enrolment.load()
    security = {field: str(target / Path(path).name) for field, path in creds.model_dump().items() if path}
    snippet = {"cluster": name, "nats_url": _nats_url(listen), "security": security}
    write_private(target / "cluster-security.yaml", yaml.safe_dump(snippet, sort_keys=False).encode())
    if output == OutputFormat.json:
        emit_json(
            {
                **snippet,
                "gateway_url": gateway_url,
                "jurisdiction": jurisdiction,
                "dir": str(target),
                "files": files,
            }
        )
        return
    table = Table(title=f"credentials for {name} in {target}", header_style="bold")
    table.add_column("file")
    table.add_column("what")
    for file_name in sorted(files):
        table.add_row(file_name, _what(file_name))
    table.add_row("cluster-security.yaml", "merge into the cluster's cluster.yaml")
    console.print(table)
    console.print(
        f"Copy {target} to the cluster (keep it 0600), merge cluster-security.yaml into its "
        "cluster.yaml, set gateway.peer_port, and start `fleetctl agent` and `fleetctl gateway`."
    )


def _register(name: str, gateway_url: str, region: str, jurisdiction: str = "") -> None:
    """Record the cluster; one already recorded (a heartbeat came first, or a re-enrolment)
    gets the gateway URL and jurisdiction given here."""
    from control_plane.client import ApiError, FleetClient

    body = {"id": name, "region": region, "gateway_url": gateway_url, "jurisdiction": jurisdiction}
    try:
        with FleetClient() as client:
            try:
                client.post("/v1/clusters", body)
            except ApiError as err:
                if err.status != 409:
                    raise
                update = {
                    k: v for k, v in (("gateway_url", gateway_url), ("jurisdiction", jurisdiction)) if v
                }
                if update:
                    client.patch(f"/v1/clusters/{name}", update)
    except ApiError as err:
        fail(f"registering {name} with the control plane: {err} (use --no-register to skip)")


def _nats_url(listen: NatsListen) -> str:
    host = os.environ.get("FLEET_NATS_PUBLIC_HOST") or listen.host
    return f"tls://{host}:{listen.port}"


def _what(file_name: str) -> str:
    return {
        "ca.pem": "the fleet CA (verifies NATS, peers, replicas)",
        "agent.pem": "the agent's NATS identity",
        "agent.key": "its private key",
        "gateway.pem": "the gateway's identity (NATS, peer listener, peer tokens)",
        "gateway.key": "its private key",
        "replica.pem": "the replicas' HTTPS certificate",
        "replica.key": "its private key",
        "replica-token": "the secret replicas require from the gateway",
        "webhook-master": "the fleet's webhook master secret (gateways sign async webhooks with it)",
    }.get(file_name, "")


def register(app: typer.Typer) -> None:
    clusters_app.command("enroll")(enroll)
