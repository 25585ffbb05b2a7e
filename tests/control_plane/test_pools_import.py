"""`fleetctl pools import` through the admin API into a real control plane, and the
live placer (MILP by default) placing onto the imported pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.control_plane.cp_server import ControlPlaneServer
from tests.control_plane.test_fleetctl_resources import as_json, fleetctl, one_line_error
from tests.polling import wait_for

GCP = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gcp_gpu_vms.csv"
pytestmark = pytest.mark.skipif(not GCP.exists(), reason=f"{GCP} is absent (shared data)")
REGIONS = ("--region", "us-central1", "--region", "europe-west4", "--region", "asia-northeast1")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("import")
    cp = ControlPlaneServer(tmp / "home", f"sqlite:///{tmp / 'fleet.db'}", loops=True).start()
    yield cp
    cp.kill()


@pytest.mark.slow
def test_import_catalog_then_place_onto_it(server):
    home = server.home
    got = as_json(home, "pools", "import", str(GCP), "--provider", "gcp", "--capacity", "4", *REGIONS)
    assert got["clusters"] == ["gcp-asia-northeast1", "gcp-europe-west4", "gcp-us-central1"]
    assert got["clusters_created"] == 3 and got["pools_created"] > 20 and got["pools_updated"] == 0
    # again: nothing changes; with a new capacity: every pool is updated
    again = as_json(home, "pools", "import", str(GCP), "--provider", "gcp", "--capacity", "4", *REGIONS)
    assert again["pools_unchanged"] == got["pools_created"] and again["clusters_created"] == 0
    bigger = as_json(home, "pools", "import", str(GCP), "--provider", "gcp", "--capacity", "6", *REGIONS)
    assert bigger["pools_updated"] == got["pools_created"]
    clusters = {c["id"]: c for c in as_json(home, "clusters")}
    assert clusters["gcp-europe-west4"]["region"] == "europe-west4"
    assert clusters["gcp-europe-west4"]["provider"] == "gcp"
    pools = as_json(home, "pools", "--cluster", "gcp-us-central1", "--tier", "spot")
    a3 = next(p for p in pools if p["name"] == "a3-highgpu-8g-spot")
    assert (a3["gpu_model"], a3["gpus_per_node"], a3["nodes"], a3["gpu_memory_gb"]) == ("H100", 8, 6, 80.0)

    # the live placer puts an H100 deployment on the cheapest H100 capacity in the allowed regions
    as_json(
        home,
        "deploy",
        "big",
        "--model",
        "m",
        "--gpu",
        "H100",
        "--regions",
        "europe-*",
        "--min-replicas",
        "2",
        "--max-replicas",
        "2",
    )

    def two_placed() -> list[dict] | None:
        placed = as_json(home, "status", "big")["placements"]
        return placed if len(placed) == 2 else None

    placed = wait_for(two_placed, 30, "two placements of big", 0.3)
    assert len(placed) == 2 and {p["cluster"] for p in placed} == {"gcp-europe-west4"}
    europe = {p["name"]: p for p in as_json(home, "pools", "--cluster", "gcp-europe-west4")}
    cheapest = min(
        (p for p in europe.values() if p["gpu_model"] == "H100"),
        key=lambda p: p["hourly_price"] / p["gpus_per_node"],
    )
    assert {p["pool"] for p in placed} == {cheapest["name"]}

    # --replace drops pools the import does not name, but never one that runs replicas
    replaced = as_json(
        home,
        "pools",
        "import",
        str(GCP),
        "--provider",
        "gcp",
        "--region",
        "europe-west4",
        "--tier",
        "on-demand",
        "--capacity",
        "6",
        "--replace",
    )
    assert replaced["pools_removed"] > 0
    if cheapest["tier"] == "spot":
        assert replaced["kept_in_use"] == [f"gcp-europe-west4/{cheapest['name']}"]


def test_import_bad_input(server, tmp_path):
    home = server.home
    bad = tmp_path / "bad.csv"
    bad.write_text("Name,Cost\nx,1\n")
    assert "Region" in one_line_error(
        fleetctl(home, "pools", "import", str(bad), "--provider", "x", ok=False)
    )
    with server.client() as admin:
        r = admin.post("/v1/pools/import", json={"provider": "Bad Name", "pools": []})
        assert r.status_code == 422
        pool = {"region": "r1", "name": "p", "gpu_model": "L4"}
        r = admin.post("/v1/pools/import", json={"provider": "acme", "pools": [pool, pool]})
        assert r.status_code == 422 and "repeats" in r.text
        admin.post("/v1/clusters", json={"id": "acme-r2", "provider": "other", "region": "r2"})
        r = admin.post("/v1/pools/import", json={"provider": "acme", "pools": [{**pool, "region": "r2"}]})
        assert r.status_code == 409 and "provider" in r.text


def test_import_sets_a_new_clusters_jurisdiction(server):
    """A catalog's Jurisdiction column gives a new capacity cluster its jurisdiction; it never
    moves an existing one's (that is `fleetctl clusters set`), and one region has one."""
    pool = {"region": "ca-r1", "name": "p", "gpu_model": "L4", "jurisdiction": "ca"}
    with server.client() as admin:
        r = admin.post("/v1/pools/import", json={"provider": "juris", "pools": [pool]})
        assert r.status_code == 200, r.text
        got = admin.get("/v1/pools", params={"cluster": "juris-ca-r1"}).json()["items"]
        assert [p["jurisdiction"] for p in got] == ["ca"]
        again = {**pool, "jurisdiction": "us"}
        r = admin.post("/v1/pools/import", json={"provider": "juris", "pools": [again]})
        assert r.status_code == 409 and "jurisdiction" in r.text
        bare = {k: v for k, v in pool.items() if k != "jurisdiction"}
        r = admin.post("/v1/pools/import", json={"provider": "juris", "pools": [bare]})
        assert r.status_code == 200
        assert (
            admin.get("/v1/pools", params={"cluster": "juris-ca-r1"}).json()["items"][0]["jurisdiction"]
            == "ca"
        )
        two = [pool, {**pool, "name": "q", "jurisdiction": "us"}]
        r = admin.post("/v1/pools/import", json={"provider": "juris", "pools": two})
        assert r.status_code == 422 and "two jurisdictions" in r.text
        r = admin.post(
            "/v1/pools/import", json={"provider": "juris", "pools": [{**pool, "jurisdiction": "C A"}]}
        )
        assert r.status_code == 422
