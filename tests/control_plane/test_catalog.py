"""SkyPilot-layout catalogs -> pool offers: columns by name, GCP's GPU-price rows, Azure's
unquoted comma, and the real files in ../shared/data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from control_plane.catalog import CatalogError, load_catalog, offers_to_pools, parse_catalog
from fleet_base.domain import Tier

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
GCP, AZURE = DATA / "gcp_gpu_vms.csv", DATA / "azure_gpu_vms.csv"
needs_data = pytest.mark.skipif(not (GCP.exists() and AZURE.exists()), reason=f"catalogs absent in {DATA}")


def _by(offers, region, itype, tier):
    return next(o for o in offers if o.region == region and o.instance_type == itype and o.tier == tier)


def test_columns_by_name_in_any_order_extra_columns_ignored():
    text = (
        "Price,Region,Extra,AcceleratorCount,InstanceType,AcceleratorName,SpotPrice,GpuInfo\n"
        "4.5,r1,x,2,big,H100,1.5,H100\n"
        "1.0,r1,x,0.5,frac,A10,,A10\n"  # fractional GPU: skipped
        "2.0,r1,x,1,tpu,tpu-v5,1.0,\n"  # TPU: skipped
    )
    offers, report = parse_catalog(text, "acme", capacity=3)
    assert [(o.instance_type, o.tier, o.hourly_price, o.nodes, o.gpus_per_node) for o in offers] == [
        ("big", Tier.on_demand, 4.5, 3, 2),
        ("big", Tier.spot, 1.5, 3, 2),
    ]
    assert offers[0].gpu_memory_gb == 80  # from the model table (GpuInfo has no MemoryInfo)
    assert report.skipped == {"fractional or missing GPU count": 1, "TPU": 1}
    assert offers[0].cluster_id == "acme-r1" and offers[0].pool_name == "big-on-demand"


def test_gcp_layout_node_price_is_host_plus_gpu_row():
    text = (
        "InstanceType,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice\n"
        "a2-highgpu-2g,,,,r1,r1-a,1.0,0.5\n"
        "a2-highgpu-2g,,,,r1,r1-b,1.2,0.6\n"
        ",A100,2,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 40960}}]},r1,r1-a,3.0,1.0\n"
        ",A100,2,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 40960}}]},r1,r1-b,3.0,1.0\n"
        ",T4,1,{'Gpus': [{'MemoryInfo': {'SizeInMiB': 16384}}]},r1,r1-a,0.35,0.1\n"
    )
    offers, report = parse_catalog(
        text, "gcp", tiers=(Tier.on_demand, Tier.spot, Tier.reserved), reserved_nodes=2
    )
    od = _by(offers, "r1", "a2-highgpu-2g", Tier.on_demand)
    assert (od.gpu_model, od.gpus_per_node, od.gpu_memory_gb, od.hourly_price) == ("A100", 2, 40.0, 4.0)
    assert od.zones == ("r1-a", "r1-b")
    assert _by(offers, "r1", "a2-highgpu-2g", Tier.spot).hourly_price == 1.5
    reserved = _by(offers, "r1", "a2-highgpu-2g", Tier.reserved)
    assert reserved.nodes == 2 and reserved.hourly_price == pytest.approx(0.6 * 4.0)
    assert report.skipped["GPU row without a host machine (attachable GPU)"] == 1


def test_azure_unquoted_comma_in_last_column():
    text = (
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,Generation\n"
        "Standard_NC12s_v3,V100,2,12,224,V100,8.468,1.564886,australiaeast,V1,V2\n"
        "Standard_NC24ads_A100_v4,A100-80GB,1,24,220,A100-80GB,5.142,,jioindiawest,V2\n"
    )
    offers, report = parse_catalog(text, "azure")
    assert {(o.instance_type, o.tier) for o in offers} == {
        ("Standard_NC12s_v3", Tier.on_demand),
        ("Standard_NC12s_v3", Tier.spot),
        ("Standard_NC24ads_A100_v4", Tier.on_demand),
    }
    assert report.skipped == {"no spot price": 1}


@pytest.mark.parametrize(
    ("text", "phrase"),
    [("", "empty"), ("InstanceType,Price\nx,1\n", "Region"), ("Region,Cost\nr,1\n", "Price")],
)
def test_not_a_catalog(text, phrase):
    with pytest.raises(CatalogError, match=phrase):
        parse_catalog(text, "x")


@needs_data
def test_real_gcp_catalog():
    offers, report = load_catalog(GCP, capacity=4)
    assert len(offers) > 500 and report.rows == 3051
    a2 = _by(offers, "asia-northeast1", "a2-highgpu-1g", Tier.on_demand)
    assert (a2.gpu_model, a2.gpus_per_node, a2.gpu_memory_gb) == ("A100", 1, 40.0)
    assert a2.hourly_price == pytest.approx(0.94803 + 1.70586)
    assert _by(offers, "asia-northeast1", "a2-highgpu-1g", Tier.spot).hourly_price == pytest.approx(
        0.47407 + 1.3974
    )
    assert {o.gpu_model for o in offers} >= {"L4", "A100", "A100-80GB", "H100", "H200", "B200"}
    assert not any(o.gpu_model.startswith("tpu") for o in offers)


@needs_data
def test_real_azure_catalog():
    offers, report = load_catalog(AZURE)
    assert report.rows == 829 and len(offers) > 1000
    v100 = _by(offers, "australiaeast", "Standard_NC12s_v3", Tier.on_demand)
    assert (v100.gpu_model, v100.gpus_per_node, v100.hourly_price) == ("V100", 2, 8.468)
    assert _by(offers, "australiaeast", "Standard_NC12s_v3", Tier.spot).hourly_price == pytest.approx(1.56489)
    pools = offers_to_pools(offers)
    assert all(p.provider == "azure" and p.cluster == f"azure-{p.region}" for p in pools)
    assert len({p.key for p in pools}) == len(pools)


@needs_data
def test_fleetctl_plan_offline(tmp_path):
    demands = Path(__file__).resolve().parents[2] / "docs" / "examples" / "demands.json"
    cmd = [sys.executable, "-m", "control_plane.cli", "plan", "--catalog", str(GCP), "--catalog", str(AZURE)]
    out = subprocess.run(
        [*cmd, "--demands", str(demands), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(out.stdout)
    wanted = {d["name"]: d["replicas"] for d in json.loads(demands.read_text())["deployments"]}
    assert (
        report["replicas"] == sum(wanted.values()) and report["unplaced"] == [] and report["violations"] == []
    )
    assert report["lp_bound"] <= report["cost_per_hour"] <= report["ffd_cost_per_hour"]
    assert {d: sum(r.values()) for d, r in report["replicas_by_region"].items()} == wanted
    assert sum(n["nodes"] * n["price"] for n in report["nodes"]) == pytest.approx(
        report["cost_per_hour"], rel=1e-6
    )
    assert all(
        r.startswith(("europe-", "northeurope", "westeurope", "germany", "france"))
        for r in report["replicas_by_region"]["eu-only"]
    )
    assert len(report["replicas_by_region"]["chat-70b"]) >= 2
    # bad input: one clear line, non-zero exit
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"deployments": [{"name": "x", "replicas": -1}]}))
    out = subprocess.run([*cmd, "--demands", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "replicas" in out.stderr
