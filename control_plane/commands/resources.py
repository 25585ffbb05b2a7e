"""fleetctl's resource commands, each one call (or a few) of the admin API:
deploy, ls, status, scale, delete, clusters, cordon/uncordon, pools, events, audit
(`fleetctl keys` is in `control_plane.commands.keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from control_plane.commands.control_plane_status import control_plane_status
from control_plane.commands.keys import keys_app
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
from control_plane.commands.residency import (
    JURISDICTION_HELP,
    RESIDENCY_HELP,
    jurisdiction_flag,
    residency_flag,
)
from fleet_base.engines import ENGINE_KINDS, tenant_notes

DEPLOYMENT_COLUMNS = {
    "name": "name",
    "model": "model",
    "engine": "engine",
    "version": "current_version",
    "desired": "desired_replicas",
    "ready": "ready_replicas",
    "min": "min_replicas",
    "max": "max_replicas",
    "priority": "priority",
    "surge": "max_surge",
    "unavail": "max_unavailable",
    "residency": "residency",
}
PLACEMENT_COLUMNS = {
    "replica": "replica_id",
    "cluster": "cluster",
    "region": "region",
    "pool": "pool",
    "version": "version",
    "state": "state",
    "url": "url",
    # the replica's cold start in parts (seconds), from `startup`
    "cold start": "cold_start_s",
    "pull": "pull_s",
    "load": "load_s",
    "warm-up": "warmup_s",
    "1st token": "first_token_s",
}
VERSION_COLUMNS = {
    "version": "version",
    "model": "model",
    "engine": "engine",
    "gpus": "gpu_models",
    "count": "gpu_count",
    "min": "min_replicas",
    "max": "max_replicas",
    "down delay": "scale_down_delay",  # `_print_status`: the version's seconds, or "derived"
    "regions": "regions",
    "replicas": "replicas",
    "current": "current",
}
CLUSTER_COLUMNS = {
    "id": "id",
    "provider": "provider",
    "region": "region",
    "jurisdiction": "jurisdiction",
    "status": "status",
    "gateway": "gateway_url",
    "replicas": "replicas",
    "heartbeat": "last_heartbeat_at",
}
POOL_COLUMNS = {
    "cluster": "cluster",
    "region": "region",
    "jurisdiction": "jurisdiction",
    "pool": "name",
    "gpu": "gpu_model",
    "mem GB": "gpu_memory_gb",
    "tier": "tier",
    "$/h": "hourly_price",
    "total": "total_gpus",
    "used": "used_gpus",
    "free": "free_gpus",
}
EVENT_COLUMNS = {
    "at": "at",
    "kind": "kind",
    "deployment": "deployment",
    "cluster": "cluster",
    "message": "message",
}
AUDIT_COLUMNS = {"at": "at", "actor": "actor", "action": "action", "resource": "resource_id"}


# --------------------------------------------------------------------- deployments


def _parse_value(text: str) -> Any:
    """engine-arg values: true/false, integers and numbers as such, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--engine-arg {pair!r}: expected KEY=VALUE")
        args[key.strip().lstrip("-")] = _parse_value(value)
    return args


def _load_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror}")
    except yaml.YAMLError as err:
        fail(f"{path} is not valid YAML: {str(err).splitlines()[0]}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        fail(f"{path}: expected a mapping of deployment fields")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _delay(seconds: float | None) -> str:
    """A version's scale-down delay as a person reads it: null is derived from the cold start."""
    return "derived" if seconds is None else f"{seconds:g} s"


def _print_status(status: dict, output: OutputFormat) -> None:
    if output == OutputFormat.json:
        emit_json(status)
        return
    show(status, output, DEPLOYMENT_COLUMNS, title=f"deployment {status['name']}")
    versions = [{**v, "scale_down_delay": _delay(v.get("scale_down_delay_s"))} for v in status["versions"]]
    show(versions, output, VERSION_COLUMNS, title="versions")
    if status["placements"]:
        rows = [
            {**p, **{f"{k}_s": v for k, v in (p.get("startup") or {}).items()}} for p in status["placements"]
        ]
        show(rows, output, PLACEMENT_COLUMNS, title="placements (cold start in seconds)")
    else:
        console.print("no replicas placed yet")


# `--engine`'s choices, fleet_base.engines.EngineKind's values (Typer lists an Enum's values).
EngineChoice = Enum("EngineChoice", {kind.replace(".", "_"): kind for kind in ENGINE_KINDS}, type=str)
ENGINE_HELP = (
    "the server that runs the replicas: fleet (default), vllm, sglang or llama.cpp (a GGUF --model); "
    "a different engine is a new version"
)
ENGINE_ARG_HELP = (
    "engine flag KEY=VALUE (repeatable; the whole set): the engine's own flag names, e.g. "
    "tensor_parallel_size=4 (vllm), tp_size=4 (sglang), n_gpu_layers=99 (llama.cpp)"
)
PRIORITY_HELP = "placement class: critical, standard (default) or batch; a higher one may preempt a lower one"
SURGE_HELP = 'replicas a rollout may add above the desired count: a count or a percentage (default "25%")'
UNAVAILABLE_HELP = (
    'replicas a rollout may take out of service: a count or a percentage (default "25%", at least 1)'
)


def deploy(
    name: str = typer.Argument(None, help="deployment name (or `name:` in -f FILE)"),
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="model alias, .gguf file, Hugging Face directory or URI (s3://, hf://org/repo\\[@rev]\\[/file], oci://, https://...#sha256=)",
    ),
    replicas: int = typer.Option(None, "--replicas", "-r", help="a fixed replica count (min = max = N)"),
    min_replicas: int = typer.Option(None, "--min-replicas", help="autoscaling lower bound"),
    max_replicas: int = typer.Option(None, "--max-replicas", help="autoscaling upper bound"),
    gpu: list[str] = typer.Option(None, "--gpu", help="acceptable GPU model (repeatable; none: any)"),
    gpus: int = typer.Option(None, "--gpus", help="GPUs per replica"),
    gpu_memory: float = typer.Option(None, "--gpu-memory", help="GPU memory per GPU, GB"),
    regions: str = typer.Option(None, "--regions", help="allowed regions, comma-separated (none: any)"),
    min_regions: int = typer.Option(None, "--min-regions", help="spread replicas over at least N regions"),
    standby: list[str] = typer.Option(
        None,
        "--standby",
        help="warm standby region at min replicas, serving only while primaries are down (repeatable)",
    ),
    engine: EngineChoice = typer.Option(None, "--engine", help=ENGINE_HELP),
    engine_arg: list[str] = typer.Option(None, "--engine-arg", "-e", help=ENGINE_ARG_HELP),
    scale_to_zero: bool = typer.Option(
        None, "--scale-to-zero/--no-scale-to-zero", help="allow zero replicas"
    ),
    target_concurrency: float = typer.Option(
        None, "--target-concurrency", help="autoscaling target per replica"
    ),
    slo_ttft: float = typer.Option(None, "--slo-ttft", help="autoscaling TTFT target, seconds (default 2)"),
    slo_itl: float = typer.Option(
        None, "--slo-itl", help="autoscaling inter-token latency target, seconds (default 0.1)"
    ),
    priority: str = typer.Option(None, "--priority", help=PRIORITY_HELP),
    max_surge: str = typer.Option(None, "--max-surge", help=SURGE_HELP),
    max_unavailable: str = typer.Option(None, "--max-unavailable", help=UNAVAILABLE_HELP),
    lora: list[str] = typer.Option(
        None, "--lora", help="LoRA adapter NAME=URI served on this deployment (repeatable; the whole set)"
    ),
    max_adapters: int = typer.Option(None, "--max-adapters", help="LoRA adapters one replica holds at once"),
    residency: str = typer.Option(None, "--residency", help=RESIDENCY_HELP),
    file: Path = typer.Option(
        None, "--file", "-f", help="deployment YAML (the API's fields); flags override it"
    ),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Create a deployment, or update it when NAME exists (a changed spec makes a new version)."""
    from control_plane.commands.lora import adapter_pairs

    body: dict[str, Any] = _load_file(file) if file else {}
    name = name or body.pop("name", None)
    body.pop("name", None)
    if not name:
        fail("a deployment NAME is required (argument or `name:` in -f FILE)")
    flags = {
        "model": model,
        "replicas": replicas,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "gpu_models": list(gpu) if gpu else None,
        "gpu_count": gpus,
        "gpu_memory_gb": gpu_memory,
        "regions": [r.strip() for r in regions.split(",") if r.strip()] if regions is not None else None,
        "min_regions": min_regions,
        "standby_regions": [r.strip() for item in standby for r in item.split(",") if r.strip()]
        if standby
        else None,
        "engine": engine.value if engine else None,
        "engine_args": _engine_args(engine_arg) if engine_arg else None,
        "scale_to_zero": scale_to_zero,
        "target_concurrency": target_concurrency,
        "slo_ttft_s": slo_ttft,
        "slo_itl_s": slo_itl,
        "priority": priority,
        "max_surge": max_surge,
        "max_unavailable": max_unavailable,
        "adapters": adapter_pairs(lora) if lora else None,
        "max_adapters": max_adapters,
    }
    body.update({k: v for k, v in flags.items() if v is not None})
    if residency is not None:
        body["residency"] = residency_flag(residency)  # None clears the policy

    def run(client) -> dict:
        from control_plane.client import ApiError

        try:
            client.get(f"/v1/deployments/{name}")
        except ApiError as err:
            if err.status != 404:
                raise
            if "model" not in body:
                fail(f"deployment {name!r} does not exist yet: --model is required to create it")
            return client.post("/v1/deployments", {"name": name, **body})
        update = dict(body)
        # Declarative: `--replicas N` alone means a fixed count, on update as on create.
        if "replicas" in update and "min_replicas" not in update and "max_replicas" not in update:
            update["min_replicas"] = update["max_replicas"] = update["replicas"]
        return client.patch(f"/v1/deployments/{name}", update)

    status = call(run)
    _print_status(status, output)
    if output != OutputFormat.json:  # JSON stays the API's answer
        for note in deploy_notes(status):
            console.print(f"note: {note}", markup=False, highlight=False)


def deploy_notes(status: dict) -> list[str]:
    """What the deployment gives up on its engine, said when it is deployed."""
    engine = status.get("engine", "fleet")
    return tenant_notes(engine) if engine in ENGINE_KINDS else []


def list_deployments(
    model: str = typer.Option(None, "--model", help="only deployments of this model"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """List deployments."""
    rows = call(lambda c: c.items("/v1/deployments", model=model))
    show(rows, output, DEPLOYMENT_COLUMNS, title="deployments")


def status(
    name: str = typer.Argument(None, help="deployment name (none: the control plane's instances)"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """A deployment's versions, desired and ready replicas, and where they run; without a
    name, the control plane's instances, its leader and epoch, and its scheduled jobs."""
    if name is None:
        control_plane_status(output)
        return
    _print_status(call(lambda c: c.get(f"/v1/deployments/{name}")), output)


def scale(
    name: str = typer.Argument(..., help="deployment name"),
    replicas: int = typer.Argument(..., help="desired replicas (within the version's min..max)"),
    priority: str = typer.Option(None, "--priority", help=PRIORITY_HELP),
    max_surge: str = typer.Option(None, "--max-surge", help=SURGE_HELP),
    max_unavailable: str = typer.Option(None, "--max-unavailable", help=UNAVAILABLE_HELP),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Set a deployment's desired replica count (and, optionally, its class and surge budget)."""
    body: dict[str, Any] = {"replicas": replicas}
    given = {"priority": priority, "max_surge": max_surge, "max_unavailable": max_unavailable}
    body.update({k: v for k, v in given.items() if v is not None})
    _print_status(call(lambda c: c.post(f"/v1/deployments/{name}/scale", body)), output)


def delete(
    name: str = typer.Argument(..., help="deployment name"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Delete a deployment (its replicas are stopped)."""
    gone = call(lambda c: c.delete(f"/v1/deployments/{name}"))
    done(gone, output, f"deleted {name} ({len(gone['placements'])} replica(s) to stop)")


# --------------------------------------------------------------------- clusters and pools


clusters_app = typer.Typer(help="List clusters (`fleetctl clusters`), enrol one (`clusters enroll NAME`).")


def clusters(
    ctx: typer.Context,
    status: str = typer.Option(None, "--status", help="healthy, unhealthy or draining"),
    region: str = typer.Option(None, "--region"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """List clusters."""
    if ctx.invoked_subcommand is not None:
        return
    show(
        call(lambda c: c.items("/v1/clusters", status=status, region=region)),
        output,
        CLUSTER_COLUMNS,
        title="clusters",
    )


def clusters_set(
    cluster: str = typer.Argument(..., help="cluster id"),
    jurisdiction: str = typer.Option(None, "--jurisdiction", help=JURISDICTION_HELP),
    gateway_url: str = typer.Option(None, "--gateway-url", help="its gateway's peer URL"),
    region: str = typer.Option(None, "--region"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Change a cluster's recorded fields; routes and desired state are republished at once."""
    body: dict[str, Any] = {}
    if jurisdiction is not None:
        body["jurisdiction"] = jurisdiction_flag(jurisdiction)
    if gateway_url is not None:
        body["gateway_url"] = gateway_url
    if region is not None:
        body["region"] = region
    if not body:
        fail("nothing to change: give --jurisdiction, --gateway-url or --region")
    show(call(lambda c: c.patch(f"/v1/clusters/{cluster}", body)), output, CLUSTER_COLUMNS)


def _set_status(cluster: str, value: str, output: OutputFormat) -> None:
    row = call(lambda c: c.patch(f"/v1/clusters/{cluster}", {"status": value}))
    show(row, output, CLUSTER_COLUMNS)


def cordon(
    cluster: str = typer.Argument(..., help="cluster id"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Mark a cluster draining: it keeps serving what it runs and gets no new replicas."""
    _set_status(cluster, "draining", output)


def uncordon(
    cluster: str = typer.Argument(..., help="cluster id"), output: OutputFormat = OUTPUT_OPTION
) -> None:
    """Make a cordoned cluster eligible for new replicas again."""
    _set_status(cluster, "healthy", output)


pools_app = typer.Typer(
    help="Capacity pools: list them (no subcommand), or `import` a provider catalog.",
    invoke_without_command=True,
)


def pools(
    ctx: typer.Context,
    cluster: str = typer.Option(None, "--cluster"),
    gpu_model: str = typer.Option(None, "--gpu-model"),
    tier: str = typer.Option(None, "--tier", help="reserved, on-demand or spot"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """List capacity pools with used and free GPUs."""
    if ctx.invoked_subcommand is not None:
        return
    rows = call(lambda c: c.items("/v1/pools", cluster=cluster, gpu_model=gpu_model, tier=tier))
    show(rows, output, POOL_COLUMNS, title="capacity pools")


# --------------------------------------------------------------------- history


def events(
    deployment: str = typer.Option(None, "--deployment"),
    cluster: str = typer.Option(None, "--cluster"),
    kind: str = typer.Option(None, "--kind"),
    limit: int = typer.Option(50, "--limit", min=1, max=10_000),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Recent events, newest first."""
    rows = call(
        lambda c: c.items("/v1/events", limit=limit, deployment=deployment, cluster=cluster, kind=kind)
    )
    show(rows, output, EVENT_COLUMNS, title="events")


def audit(
    resource_type: str = typer.Option(None, "--resource-type", help="deployment, cluster, pool, key, ..."),
    resource_id: str = typer.Option(None, "--resource-id"),
    limit: int = typer.Option(50, "--limit", min=1, max=10_000),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Who changed what, newest first (`-o json` shows before and after)."""
    rows = call(
        lambda c: c.items("/v1/audit", limit=limit, resource_type=resource_type, resource_id=resource_id)
    )
    show(rows, output, AUDIT_COLUMNS, title="audit")


def register(app: typer.Typer) -> None:
    """The resource commands and groups, in the order `fleetctl --help` lists them."""
    clusters_app.callback(invoke_without_command=True)(clusters)
    clusters_app.command("set")(clusters_set)
    pools_app.callback()(pools)
    entries: tuple[tuple[str, Callable[..., None] | typer.Typer], ...] = (
        ("deploy", deploy),
        ("ls", list_deployments),
        ("status", status),
        ("scale", scale),
        ("delete", delete),
        ("clusters", clusters_app),
        ("cordon", cordon),
        ("uncordon", uncordon),
        ("pools", pools_app),
        ("keys", keys_app),
        ("events", events),
        ("audit", audit),
    )
    for name, entry in entries:
        if isinstance(entry, typer.Typer):
            app.add_typer(entry, name=name)
        else:
            app.command(name)(entry)
