"""SkyPilot-layout GPU catalogs -> pool offers, one per (provider, region, instance type,
tier).

Columns are found by name (any order, extra columns ignored): InstanceType,
AcceleratorName, AcceleratorCount, GpuInfo, Price, SpotPrice, Region, AvailabilityZone,
and Fleet's own optional Jurisdiction (the legal home of a region's data, `ca`, `us`; one
per region, empty: none, which no residency policy allows).
Two real-world quirks are handled:

- GCP: a GPU's price is its own row (empty InstanceType) and the host row of an
  accelerator-optimized machine (a2/a3/a4/g2) names no accelerator; the node price is
  host + GPU row of the same zone, the GPU model and count come from the machine family.
  GPU rows with no host machine in the file (N1-attachable T4/V100/P4/P100) are skipped
  and counted: pricing them without a host would understate them.
- Azure: `V1,V2` in the last column (Generation) is not quoted, so a row has one field
  too many; surplus fields are folded into the last column.

Zones of a region collapse into one pool at the cheapest zone's price. TPUs and
fractional GPUs are skipped.
"""

from __future__ import annotations

import csv
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from control_plane.catalog.gpus import gcp_machine_gpus, memory_from_info
from control_plane.placement.base import PoolCapacity
from fleet_base.domain import PoolShape, Tier, pool_shape
from fleet_base.residency import normalize

REQUIRED = ("Region", "Price")


class CatalogError(ValueError):
    """The file cannot be read as a catalog (the message says why)."""


class PoolOffer(PoolShape):
    """What a provider sells in one region: `nodes` is how many may be acquired (reserved:
    how many are committed), `hourly_price` for reserved the committed price."""

    model_config = ConfigDict(frozen=True)

    provider: str
    region: str
    instance_type: str
    zones: tuple[str, ...] = ()
    jurisdiction: str = ""

    @property
    def cluster_id(self) -> str:
        """One cluster record per (provider, region)."""
        return cluster_id(self.provider, self.region)

    @property
    def pool_name(self) -> str:
        return pool_name(self.instance_type, self.tier)


def cluster_id(provider: str, region: str) -> str:
    return f"{provider}-{region}"[:63].strip("-_")


def pool_name(instance_type: str, tier: Tier) -> str:
    base = "".join(c if c.isalnum() or c in "-_" else "-" for c in instance_type)
    suffix = f"-{tier.value}"
    return (base[: 63 - len(suffix)] + suffix).strip("-_")


class CatalogReport(BaseModel):
    """What was read and what was left out, for the operator."""

    rows: int = 0
    offers: int = 0
    skipped: dict[str, int] = Field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _rows(text: str) -> tuple[list[str], list[dict[str, str]]]:
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise CatalogError("the catalog is empty") from None
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise CatalogError(f"the catalog has no column {', '.join(missing)} (header: {', '.join(header)})")
    out = []
    for fields in reader:
        if not any(f.strip() for f in fields):
            continue
        if len(fields) > len(header):  # Azure: unquoted comma in the last column
            fields = [*fields[: len(header) - 1], ",".join(fields[len(header) - 1 :])]
        fields = fields + [""] * (len(header) - len(fields))
        out.append({h: f.strip() for h, f in zip(header, fields, strict=True)})
    return header, out


_GpuKey = tuple[str, str, str, int]  # (region, zone, GPU model, GPUs per node)
_Node = tuple[str, int, float, "float | None", "float | None"]  # (model, count, memory, price, spot)


def _gpu_rows(rows: list[dict[str, str]]) -> dict[_GpuKey, tuple[float | None, float | None]]:
    """GCP's per-GPU price rows (no instance type): (price, spot price) by zone and count."""
    gpu_rows: dict[_GpuKey, tuple[float | None, float | None]] = {}
    for r in rows:
        if not r.get("InstanceType") and r.get("AcceleratorName"):
            count = _float(r.get("AcceleratorCount", ""))
            if count is None or count < 1 or count != int(count):
                continue
            key = (r["Region"], r.get("AvailabilityZone", ""), r["AcceleratorName"], int(count))
            gpu_rows[key] = (_float(r.get("Price", "")), _float(r.get("SpotPrice", "")))
    return gpu_rows


def _node_of(
    r: dict[str, str],
    gpu_rows: dict[_GpuKey, tuple[float | None, float | None]],
    used_gpu_rows: set[_GpuKey],
    report: CatalogReport,
) -> _Node | None:
    """One instance row as a node (None, with the reason in `report`, when it is not one)."""
    acc, itype = r.get("AcceleratorName", ""), r.get("InstanceType", "")
    region, zone = r["Region"], r.get("AvailabilityZone", "")
    price, spot = _float(r.get("Price", "")), _float(r.get("SpotPrice", ""))
    if acc:
        if acc.lower().startswith("tpu"):
            report.skip("TPU")
            return None
        count = _float(r.get("AcceleratorCount", ""))
        if count is None or count < 1 or count != int(count):
            report.skip("fractional or missing GPU count")
            return None
        model, n, info = acc, int(count), r.get("GpuInfo", "")
    else:
        built_in = gcp_machine_gpus(itype)
        if built_in is None:
            report.skip("no accelerator")
            return None
        model, n = built_in
        key = (region, zone, model, n)
        if key not in gpu_rows:
            report.skip("host without a GPU price row in its zone")
            return None
        used_gpu_rows.add(key)
        gpu_price, gpu_spot = gpu_rows[key]
        price = None if price is None or gpu_price is None else price + gpu_price
        spot = None if spot is None or gpu_spot is None else spot + gpu_spot
        info = ""
    return model, n, memory_from_info(info, model), price, spot


def _nodes(
    rows: list[dict[str, str]], report: CatalogReport
) -> tuple[dict[tuple[str, str], dict[str, _Node]], dict[str, str]]:
    """(region, instance type) -> zone -> node, and GPU model -> its GpuInfo text."""
    gpu_rows = _gpu_rows(rows)
    used_gpu_rows: set[_GpuKey] = set()
    nodes: dict[tuple[str, str], dict[str, _Node]] = defaultdict(dict)
    gpu_info: dict[str, str] = {}
    for r in rows:
        acc, itype = r.get("AcceleratorName", ""), r.get("InstanceType", "")
        if acc:
            gpu_info.setdefault(acc, r.get("GpuInfo", ""))
        if not itype:
            continue
        if not r["Region"]:
            report.skip("no region")
            continue
        node = _node_of(r, gpu_rows, used_gpu_rows, report)
        if node is not None:
            nodes[(r["Region"], itype)][r.get("AvailabilityZone", "")] = node
    for key in gpu_rows.keys() - used_gpu_rows:
        report.skip(
            "TPU" if key[2].lower().startswith("tpu") else "GPU row without a host machine (attachable GPU)"
        )
    return nodes, gpu_info


def _jurisdictions(rows: list[dict[str, str]]) -> dict[str, str]:
    """Region -> its jurisdiction from the optional column; CatalogError on a bad label or
    a region given two."""
    out: dict[str, str] = {}
    for r in rows:
        text, region = r.get("Jurisdiction", ""), r["Region"]
        if not text or not region:
            continue
        try:
            label = normalize(text)
        except ValueError as e:
            raise CatalogError(f"region {region}: {e}") from None
        if out.setdefault(region, label) != label:
            raise CatalogError(f"region {region} has two jurisdictions: {out[region]} and {label}")
    return out


def parse_catalog(
    text: str,
    provider: str,
    capacity: int = 8,
    tiers: Sequence[Tier] = (Tier.on_demand, Tier.spot),
    reserved_nodes: int | None = None,
    committed_factor: float = 0.6,
) -> tuple[list[PoolOffer], CatalogReport]:
    """Offers of a catalog's text. `capacity`: nodes that may be acquired per on-demand or
    spot pool; reserved pools (when `Tier.reserved` is in `tiers`) hold `reserved_nodes`
    (default `capacity`) nodes committed at `committed_factor` x the on-demand price."""
    if capacity < 0:
        raise CatalogError("capacity must be >= 0")
    _, rows = _rows(text)
    report = CatalogReport(rows=len(rows))
    nodes, gpu_info = _nodes(rows, report)
    jurisdictions = _jurisdictions(rows)
    offers: list[PoolOffer] = []
    for (region, itype), zones in sorted(nodes.items()):
        model, n, memory, _, _ = next(iter(zones.values()))
        if not memory:
            memory = memory_from_info(gpu_info.get(model, ""), model)
        on_demand = [z[3] for z in zones.values() if z[3] is not None and z[3] > 0]
        spot = [z[4] for z in zones.values() if z[4] is not None and z[4] > 0]
        for tier in tiers:
            if tier == Tier.spot:
                prices, count = spot, capacity
            elif tier == Tier.reserved:
                prices = [p * committed_factor for p in on_demand]
                count = capacity if reserved_nodes is None else reserved_nodes
            else:
                prices, count = on_demand, capacity
            if not prices:
                report.skip(f"no {tier.value} price")
                continue
            offers.append(
                PoolOffer(
                    provider=provider,
                    region=region,
                    instance_type=itype,
                    gpu_model=model,
                    gpus_per_node=n,
                    gpu_memory_gb=memory,
                    tier=tier,
                    hourly_price=round(min(prices), 5),
                    nodes=count,
                    zones=tuple(sorted(z for z in zones if z)),
                    jurisdiction=jurisdictions.get(region, ""),
                )
            )
    report.offers = len(offers)
    return offers, report


def load_catalog(
    path: str | Path, provider: str | None = None, **kwargs
) -> tuple[list[PoolOffer], CatalogReport]:
    """A catalog file; the provider defaults to the file name's first word (gcp_gpu_vms.csv -> gcp)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CatalogError(f"cannot read {path}: {e}") from None
    return parse_catalog(text, provider or path.stem.split("_")[0].lower(), **kwargs)


def offers_to_pools(offers: Iterable[PoolOffer]) -> list[PoolCapacity]:
    """The placer's view of catalog offers (one cluster per provider and region)."""
    return [
        PoolCapacity(
            cluster=o.cluster_id,
            name=o.pool_name,
            region=o.region,
            provider=o.provider,
            jurisdiction=o.jurisdiction,
            **pool_shape(o),
        )
        for o in offers
    ]
