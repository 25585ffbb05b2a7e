"""`fleetctl pools import CATALOG.csv --provider NAME`: read a SkyPilot-layout catalog
here (control_plane.catalog) and create its pools through the admin API
(POST /v1/pools/import), one cluster record per (provider, region)."""

from __future__ import annotations

from pathlib import Path

import typer

from control_plane.commands.output import OUTPUT_OPTION, OutputFormat, call, console, emit_json, fail
from control_plane.commands.resources import pools_app
from fleet_base.domain import Tier

BATCH = 2000  # pools per request (the API takes at most 10,000 and 1 MiB)


def import_pools(
    catalog: Path = typer.Argument(..., help="SkyPilot-layout CSV (e.g. ../shared/data/gcp_gpu_vms.csv)"),
    provider: str = typer.Option(
        None, "--provider", help="provider name (default: the file name's first word)"
    ),
    capacity: int = typer.Option(8, "--capacity", min=0, help="nodes that may be acquired per pool"),
    tier: list[Tier] = typer.Option(
        None, "--tier", help="tiers to import (repeatable; default on-demand and spot)"
    ),
    reserved_nodes: int = typer.Option(
        None, "--reserved-nodes", min=0, help="committed nodes per reserved pool"
    ),
    committed_factor: float = typer.Option(
        0.6, "--committed-factor", min=0.0, help="reserved price / on-demand"
    ),
    region: list[str] = typer.Option(None, "--region", help="only these regions (repeatable)"),
    replace: bool = typer.Option(False, "--replace", help="drop the clusters' other pools (unless in use)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="parse and show, import nothing"),
    output: OutputFormat = OUTPUT_OPTION,
) -> None:
    """Import a provider catalog's GPU offers as capacity pools."""
    from control_plane.catalog import CatalogError, load_catalog

    try:
        offers, report = load_catalog(
            catalog,
            provider=provider,
            capacity=capacity,
            tiers=tuple(tier or (Tier.on_demand, Tier.spot)),
            reserved_nodes=reserved_nodes,
            committed_factor=committed_factor,
        )
    except CatalogError as e:
        fail(str(e))
    if region:
        offers = [o for o in offers if o.region in set(region)]
    if not offers:
        fail(f"{catalog}: no GPU offers to import (skipped: {report.skipped})")
    pools = [
        {
            "region": o.region,
            "name": o.pool_name,
            "gpu_model": o.gpu_model,
            "gpu_memory_gb": o.gpu_memory_gb,
            "gpus_per_node": o.gpus_per_node,
            "nodes": o.nodes,
            "tier": o.tier.value,
            "hourly_price": o.hourly_price,
            **({"jurisdiction": o.jurisdiction} if o.jurisdiction else {}),
        }
        for o in offers
    ]
    name = offers[0].provider
    if dry_run:
        summary = {
            "provider": name,
            "pools": len(pools),
            "regions": len({o.region for o in offers}),
            **report.model_dump(),
        }
        emit_json(summary) if output == OutputFormat.json else console.print(summary)
        return
    totals: dict = {}
    for start in range(0, len(pools), BATCH):
        body = {"provider": name, "pools": pools[start : start + BATCH], "replace": replace}
        got = call(lambda c, body=body: c.post("/v1/pools/import", body))
        for k, v in got.items():
            totals[k] = (
                sorted(set(totals.get(k, [])) | set(v))
                if isinstance(v, list)
                else (totals.get(k, 0) + v if isinstance(v, int) else v)
            )
    totals["skipped_rows"] = report.skipped
    if output == OutputFormat.json:
        emit_json(totals)
        return
    console.print(
        f"{name}: {totals['pools_created']} pool(s) created, {totals['pools_updated']} updated, "
        f"{totals['pools_unchanged']} unchanged, {totals['pools_removed']} removed in "
        f"{len(totals['clusters'])} cluster(s) ({totals['clusters_created']} new)",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """`fleetctl pools import` (the pools group lives with the other resource commands)."""
    pools_app.command("import")(import_pools)
