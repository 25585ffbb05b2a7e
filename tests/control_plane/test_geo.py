"""Region latencies (Skyplane's measurements, great-circle fallback) and the geo-aware
routing table: for clients in five regions the first choice is the nearest cluster with
capacity, and spillover follows latency order."""

from __future__ import annotations

import pytest

from control_plane.geo import REGION_COORDS, LatencyMatrix, estimate_rtt_ms, great_circle_km
from control_plane.geo.latency import DEFAULT_CSV, canonical
from control_plane.geo.routes import ClientRegion, by_region_for, rank_clusters, routes_by_region
from fleet_base.domain import Coordinates
from fleet_base.protocol import ClusterRoute

needs_data = pytest.mark.skipif(not DEFAULT_CSV.exists(), reason=f"{DEFAULT_CSV} is absent (shared data)")


@pytest.fixture(scope="module")
def skyplane() -> LatencyMatrix:
    if not DEFAULT_CSV.exists():
        pytest.skip(f"{DEFAULT_CSV} is absent (shared data)")
    return LatencyMatrix.from_csv(DEFAULT_CSV)


def test_ids_and_fallback_estimates():
    assert canonical("gcp:us-central1-a") == "gcp:us-central1"
    assert canonical("azure:eastus") == "azure:eastus"
    lat = LatencyMatrix()  # no measurements at all
    assert lat.resolve("us-central1") == "gcp:us-central1"
    assert lat.resolve("eastus") == "azure:eastus"
    assert lat.rtt_ms("us-east4", "us-east4", provider="gcp") == 1.0
    assert lat.rtt_ms("local-east", "local-west") is None
    # New York-ish to Iowa: one to two time zones; a few ms to tens of ms of RTT
    near = lat.rtt_ms("us-east4", "us-central1", provider="gcp", provider_b="gcp")
    far = lat.rtt_ms("us-east4", "asia-southeast1", provider="gcp", provider_b="gcp")
    assert 10 < near < 50 < 150 < far < 400
    assert estimate_rtt_ms(0) == 1.0
    assert great_circle_km(REGION_COORDS["gcp:europe-west2"], REGION_COORDS["azure:uksouth"]) < 1


@needs_data
def test_measured_rtts_are_loaded_and_symmetric(skyplane):
    assert len(skyplane.regions) == 69
    a = skyplane.rtt_ms("us-west-2", "eu-north-1", provider="aws", provider_b="aws")
    b = skyplane.rtt_ms("eu-north-1", "us-west-2", provider="aws", provider_b="aws")
    assert a == b and 120 < a < 250
    # every measured region has coordinates for the fallback
    assert all(r in REGION_COORDS for r in skyplane.regions)
    # a region Skyplane never measured (gcp us-south1) still gets an estimate
    assert skyplane.measured("gcp:us-south1", "gcp:us-east4") is None
    assert 20 < skyplane.rtt_ms("us-south1", "us-east4", provider="gcp", provider_b="gcp") < 80


CLUSTERS = [  # cluster, provider, region, ready replicas
    ("gcp-us-east4", "gcp", "us-east4", 4),
    ("gcp-europe-west4", "gcp", "europe-west4", 2),
    ("azure-japaneast", "azure", "japaneast", 3),
    ("gcp-asia-southeast1", "gcp", "asia-southeast1", 1),
    ("azure-westus", "azure", "westus", 2),
    ("aws-sa-east-1", "aws", "sa-east-1", 0),  # no capacity now: always last
]
CLIENTS = [
    ("aws", "us-east-1"),
    ("azure", "westeurope"),
    ("gcp", "asia-northeast1"),
    ("aws", "ap-southeast-2"),
    ("aws", "us-west-2"),
]


def _routes() -> list[ClusterRoute]:
    return [
        ClusterRoute(cluster=c, provider=p, region=r, replicas=n, gateway_url=f"http://{c}:8080")
        for c, p, r, n in CLUSTERS
    ]


@needs_data
def test_routing_table_on_real_latencies_for_five_client_regions(skyplane):
    routes = _routes()
    clients = [ClientRegion(region=r, provider=p) for p, r in CLIENTS]
    table = routes_by_region(routes, clients, skyplane)
    assert set(table) == {r for _, r in CLIENTS}
    firsts = {}
    for provider, region in CLIENTS:
        ranked = table[region]
        with_room = [(c, p, r) for c, p, r, n in CLUSTERS if n > 0]
        rtts = {c: skyplane.rtt_ms(region, r, provider=provider, provider_b=p) for c, p, r in with_room}
        # first choice: the nearest cluster with capacity, by measured RTT
        assert ranked[0].cluster == min(rtts, key=rtts.get)
        # spillover follows latency order; the cluster without replicas comes last
        assert [c.cluster for c in ranked[:-1]] == sorted(rtts, key=rtts.get)
        assert ranked[-1].cluster == "aws-sa-east-1"
        assert [c.rtt_ms for c in ranked[:-1]] == sorted(c.rtt_ms for c in ranked[:-1])
        assert sum(c.weight for c in ranked) == pytest.approx(1.0)
        firsts[region] = ranked[0].cluster
    assert firsts == {
        "us-east-1": "gcp-us-east4",
        "westeurope": "gcp-europe-west4",
        "asia-northeast1": "azure-japaneast",
        "ap-southeast-2": "gcp-asia-southeast1",
        "us-west-2": "azure-westus",
    }


def test_unhealthy_clusters_are_left_out_and_weights_follow_capacity():
    routes = _routes()
    routes[0] = routes[0].model_copy(update={"healthy": False})
    ranked = rank_clusters(ClientRegion(region="us-east1", provider="gcp"), routes, LatencyMatrix())
    assert "gcp-us-east4" not in {c.cluster for c in ranked}
    weights = {c.cluster: c.weight for c in ranked}
    assert weights["azure-japaneast"] == pytest.approx(3 / 8)


def test_local_regions_fall_back_to_reported_coordinates():
    class Row:
        def __init__(self, id, region, lat, lon):
            self.id, self.region, self.provider, self.gateway_url = id, region, "local", f"http://{id}"
            self.coordinates = Coordinates(lat=lat, lon=lon)

    rows = [Row("east", "local-east", 40.7, -74.0), Row("west", "local-west", 37.8, -122.4)]
    routes = [
        ClusterRoute(
            cluster=r.id, region=r.region, coordinates=r.coordinates, replicas=1, gateway_url=r.gateway_url
        )
        for r in rows
    ]
    table = by_region_for(routes, rows, LatencyMatrix())
    assert [c.cluster for c in table["local-east"]] == ["east", "west"]
    assert [c.cluster for c in table["local-west"]] == ["west", "east"]
    assert table["local-east"][1].rtt_ms > 40
