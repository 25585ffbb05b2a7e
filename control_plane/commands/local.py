"""`fleetctl up / ps / down / agent / gateway`: a whole local fleet as processes.

`up` starts nats-server, the control plane, and an agent plus a gateway per region,
waits until every cluster heart-beats, optionally deploys a model, and prints how to
call it. The components run as `python -m ...` processes; nothing here imports them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import typer
from rich.table import Table

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, console, emit, emit_json, fail
from control_plane.local.fleet import LocalFleet, pid_alive, wait_http
from control_plane.settings import fleet_home
from fleet_base.domain import is_cluster_id
from fleet_base.ports import wait_port
from fleet_base.residency import parse_jurisdictions


def _fleet() -> LocalFleet:
    return LocalFleet(fleet_home())


class _Api:
    """The few admin calls `up` makes, over HTTP like any other client."""

    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0)

    def call(self, method: str, path: str, **kwargs) -> dict | list:
        response = self.client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    def items(self, path: str, **params) -> list[dict]:
        data = self.call("GET", path, params=params)
        if isinstance(data, dict):
            for key in ("items", "data"):
                if isinstance(data.get(key), list):
                    return data[key]
        return data if isinstance(data, list) else []


def _deployment_name(model: str) -> str:
    base = Path(model).name.lower()
    base = re.sub(r"\.gguf$", "", base)
    base = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")
    return base[:63] or "model"


def _wait(what: str, check, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    with console.status(what):
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(interval)
    return None


def _print_usage(rows: list[dict], key: str, deployment: str | None) -> None:
    table = Table(title="Local fleet", header_style="bold")
    for col in ("region", "jurisdiction", "gateway", "agent pid", "gateway pid"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["region"],
            row.get("jurisdiction") or "-",
            row["gateway"],
            str(row["agent_pid"]),
            str(row["gateway_pid"]),
        )
    console.print(table)
    gateway = rows[0]["gateway"]
    model = deployment or "<deployment>"
    curl = (
        f"curl {gateway}/v1/chat/completions \\\n"
        f"  -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n"
        f'  -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\''
    )
    sdk = (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{gateway}/v1", api_key="{key}")\n'
        f'reply = client.chat.completions.create(model="{model}",\n'
        '    messages=[{"role": "user", "content": "Hello!"}])\n'
        "print(reply.choices[0].message.content)"
    )
    # Plain text, never wrapped, so it pastes as is.
    console.print("\n[bold]curl[/bold]")
    console.print(curl, soft_wrap=True, highlight=False, markup=False)
    console.print("\n[bold]OpenAI SDK (Python)[/bold]")
    console.print(sdk, soft_wrap=True, highlight=False, markup=False)
    if not deployment:
        console.print("Nothing deployed yet: [bold]fleetctl deploy NAME --model smollm2-135m[/bold]")


def up(
    regions: str = typer.Option("local-east,local-west", help="comma-separated regions; one cluster each"),
    jurisdictions: str = typer.Option(
        None, "--jurisdictions", help="each region's jurisdiction, e.g. local-east=ca,local-west=us"
    ),
    model: str | None = typer.Option(None, help="deploy this model (alias, .gguf or HF dir) once up"),
    name: str | None = typer.Option(None, help="deployment name (default: from the model)"),
    replicas: int = typer.Option(1, min=1, help="replicas of --model"),
    slots: int = typer.Option(2, min=1, help="CPU replica slots each local cluster offers"),
    replica_threads: int = typer.Option(1, min=1, help="torch threads per CPU replica"),
    detach: bool = typer.Option(False, "--detach", "-d", help="return once up; stop with `fleetctl down`"),
    wait_ready: bool = typer.Option(True, "--wait/--no-wait", help="wait for --model's replicas to be ready"),
    timeout: float = typer.Option(600.0, help="seconds to wait for each stage"),
    runtime: str = typer.Option(
        "process", help="replica runtime: process (engine) or sim (simulated replicas)"
    ),
    control_planes: int = typer.Option(
        1,
        "--control-planes",
        min=1,
        max=9,
        help="control-plane instances on one database (one leads; the CLI fails over between them)",
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Run a whole fleet on this machine: NATS, control plane(s), an agent and gateway per region."""
    fleet = _fleet()
    region_list = [r.strip() for r in regions.split(",") if r.strip()]
    if not region_list:
        fail("--regions is empty")
    for region in region_list:
        if not is_cluster_id(region):  # each region's cluster takes its name
            fail(f"region {region!r}: use lowercase letters, digits and dashes")
    if len(set(region_list)) != len(region_list):
        fail("--regions lists a region twice")
    labels = _jurisdictions(jurisdictions, region_list)
    if runtime not in ("process", "sim"):
        fail(f"--runtime {runtime!r}: use process or sim")
    if fleet.running():
        fail("a local fleet is already running under this FLEET_HOME (fleetctl ps; fleetctl down)")
    fleet.home.mkdir(parents=True, exist_ok=True)
    state = fleet.new_state(region_list, labels)
    fleet.save(state)
    try:
        deployment, key, rows = _bring_up(
            fleet,
            state,
            model,
            name,
            replicas,
            slots,
            replica_threads,
            wait_ready,
            timeout,
            runtime,
            control_planes,
        )
    except KeyboardInterrupt:
        fleet.down()
        raise typer.Exit(130) from None
    except Exception as err:
        logs = fleet.dir / "logs"
        fleet.down()
        fail(f"{err} (logs: {logs})")
    with contextlib.suppress(OSError):  # Prometheus file_sd (deploy/README.md)
        fleet.write_prometheus_targets(state)
    if output == OutputFormat.json:
        emit_json(
            {
                "fleet_id": state.fleet_id,
                "api_url": state.api_url,
                "api_urls": [p.url for p in fleet.control_planes(state)],
                "nats_url": state.nats_url,
                "ca_file": str(fleet.enrolment.pki.ca_file) if state.secure else None,
                "key": key,
                "deployment": deployment,
                "clusters": rows,
            }
        )
    else:
        _print_usage(rows, key, deployment)
        console.print(
            f"\n[bold]Console[/bold] {state.api_url}/console/ (log in with $FLEET_HOME/admin-token)"
        )
        if len(instances := fleet.control_planes(state)) > 1:
            console.print(
                f"[bold]Control planes[/bold] {', '.join(p.url for p in instances)} "
                "(one leads; `fleetctl status` shows which)",
                highlight=False,
            )
        if state.secure:
            console.print(
                f"Secured: NATS {state.nats_url} (TLS, one identity per process), replicas and peers over "
                f"HTTPS; fleet CA {fleet.enrolment.pki.ca_file} (docs/security.md)",
                highlight=False,
            )
    if detach:
        return
    _foreground(fleet)


def _jurisdictions(text: str | None, regions: list[str]) -> dict[str, str]:
    """`--jurisdictions` checked against `--regions`: every cluster it names must be one."""
    if text is None:
        return {}
    try:
        labels = parse_jurisdictions(text)
    except ValueError as err:
        fail(f"--jurisdictions {text!r}: {err}")
    unknown = sorted(set(labels) - set(regions))
    if unknown:
        fail(f"--jurisdictions names {', '.join(unknown)}, not in --regions ({', '.join(regions)})")
    return labels


def _bring_up(
    fleet: LocalFleet,
    state,
    model,
    name,
    replicas,
    slots,
    replica_threads,
    wait_ready,
    timeout,
    runtime="process",
    control_planes=1,
):
    fleet.start_nats(state)
    host, port = "127.0.0.1", int(state.nats_url.rsplit(":", 1)[1])

    if not wait_port(host, port, 15):
        raise RuntimeError("nats-server did not start")
    token_file = fleet.home / "admin-token"
    cp = _start_control_planes(fleet, state, control_planes, token_file, timeout)
    api = _Api(cp.url, token_file.read_text().strip())
    replica_args = ["--threads", str(replica_threads)]
    rows = []
    for index, region in enumerate(state.regions):
        config = fleet.write_cluster_config(state, region, index, slots, replica_args, runtime)
        agent, gateway = fleet.start_cluster(state, config)
        rows.append(
            {
                "region": region,
                "jurisdiction": state.jurisdictions.get(region, ""),
                "gateway": config.gateway.url,
                "agent_pid": agent.pid,
                "gateway_pid": gateway.pid,
            }
        )

    def clusters_healthy():
        for record in state.processes:
            if not pid_alive(record.pid):
                raise RuntimeError(f"{record.kind} {record.name} exited; see {record.log}")
        clusters = {c.get("id"): c for c in api.items("/v1/clusters")}
        return all(  # enrolment registers each cluster before its first heartbeat
            clusters.get(r, {}).get("status") == "healthy" and clusters[r].get("last_heartbeat_at")
            for r in state.regions
        )

    if not _wait("waiting for every cluster's first heartbeat", clusters_healthy, timeout):
        raise RuntimeError("clusters did not register")
    for row in rows:
        if not wait_http(f"{row['gateway']}/health", timeout):
            raise RuntimeError(f"gateway {row['gateway']} did not answer")
    key = api.call("POST", "/v1/keys", json={"name": "local-quickstart", "scopes": ["inference"]})["key"]
    key_file = fleet.dir / "inference-key"
    key_file.write_text(key + "\n")
    os.chmod(key_file, 0o600)
    deployment = None
    if model:
        deployment = name or _deployment_name(model)
        body: dict = {"name": deployment, "model": model, "replicas": replicas}
        if runtime == "sim":  # simulated replicas: a short cold start, not the profile's minute
            body["engine_args"] = {"cold_start": 1.0}
        api.call("POST", "/v1/deployments", json=body)
        if wait_ready:

            def ready():
                status = api.call("GET", f"/v1/deployments/{deployment}")
                return status.get("ready_replicas", 0) >= replicas

            if not _wait(f"loading {model} ({replicas} replica(s))", ready, timeout, interval=1.0):
                raise RuntimeError(f"{deployment} did not become ready within {timeout:.0f}s")
    return deployment, key, rows


def _start_control_planes(fleet: LocalFleet, state, count: int, token_file: Path, timeout: float):
    """`count` instances on the fleet's one database (`LocalFleet.start_control_planes`).
    Returns the first instance."""
    ports = fleet.control_plane_ports(count)
    return fleet.start_control_planes(
        state, ports, lambda records: _wait_healthy(records, token_file, timeout)
    )[0]


def _wait_healthy(records, token_file: Path, timeout: float) -> None:
    for cp in records:
        ok = _wait(
            f"starting the control plane ({cp.name})",
            lambda cp=cp: wait_http(f"{cp.url}/healthz", 1.0, proc_pid=cp.pid) and token_file.exists(),
            timeout,
            interval=0.1,
        )
        if not ok:
            raise RuntimeError(f"{cp.name} did not become healthy")


def _foreground(fleet: LocalFleet) -> None:
    console.print("Fleet is up. [bold]Ctrl-C[/bold] stops everything.")

    def _stop(signum, frame):
        raise KeyboardInterrupt

    # Explicitly, also for SIGINT: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        reported: set[int] = set()
        while True:
            time.sleep(1.0)
            state = fleet.load()
            if state is None:  # `fleetctl down` from another shell
                return
            with contextlib.suppress(OSError):  # replicas come and go: keep file_sd current
                fleet.write_prometheus_targets(state)
            for record in state.processes:
                if record.pid not in reported and not pid_alive(record.pid):
                    reported.add(record.pid)
                    console.print(
                        f"[yellow]{record.kind} {record.name} (pid {record.pid}) exited; "
                        f"log: {record.log}[/yellow]"
                    )
    except KeyboardInterrupt:
        console.print("stopping the local fleet ...")
        fleet.down()
        raise typer.Exit(0) from None


def ps(output: OutputFormat = OUTPUT_OPTION) -> None:
    """List the processes of the local fleet (kind, pid, url)."""
    rows = _fleet().ps()
    emit(rows, output, columns=["kind", "name", "pid", "alive", "url"])


def down(
    timeout: float = typer.Option(30.0, help="seconds to let each group drain before SIGKILL"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Stop every process of the local fleet (works when the control plane is already dead)."""
    fleet = _fleet()
    if fleet.load() is None:
        if output == OutputFormat.json:
            emit_json([])
        else:
            console.print("no local fleet recorded under this FLEET_HOME")
        return
    reports = [r.model_dump() for r in fleet.down(timeout)]
    emit(reports, output, columns=["step", "stopped", "killed", "seconds"], title="local fleet stopped")


def _exec_module(module: str, config: Path) -> None:
    if not config.exists():
        fail(f"config file {config} does not exist")
    os.execv(sys.executable, [sys.executable, "-m", module, "--config", str(config)])


def agent(config: Path = typer.Option(..., "--config", "-c", help="cluster.yaml")) -> None:
    """Run this cluster's agent in the foreground (`python -m agent`)."""
    _exec_module("agent", config)


def gateway(config: Path = typer.Option(..., "--config", "-c", help="cluster.yaml")) -> None:
    """Run this cluster's OpenAI-compatible gateway in the foreground (`python -m agent.gateway`)."""
    _exec_module("agent.gateway", config)


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("ps")(ps)
    app.command("down")(down)
    app.command("agent")(agent)
    app.command("gateway")(gateway)
