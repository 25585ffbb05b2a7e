"""Node health end to end on a two-cluster sim fleet (real processes): a replica made to
answer wrongly (POST /debug/corrupt, FLEET_ENGINE_TEST_HOOKS=1) is caught by the agent's
correctness probe, its node is cordoned, the control plane re-places its capacity on the
other cluster and steady load (answers and streams) through both gateways sees no failure; an XID injected
through the NVML stand-in file (FLEET_NVML_STANDIN, the library boundary) cordons the other
cluster's node and no new replica lands there. `fleetctl nodes ls -o json` shows the
record. Figures are printed (pytest -s)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from agent.health.nvml import write_standin
from agent.health.readings import GpuReading, XidEvent
from agent.security.replica_auth import replica_headers
from fleet_base.cluster_config import ClusterConfig, HealthConfig
from fleet_base.security.tls import replica_verify
from tests.e2e.sim_fleet import Load, SimFleet, wait_for
from tests.fleetctl import fleetctl_json

EAST, WEST = "local-east", "local-west"
NAME = "web"
GPUS = [GpuReading(index=0), GpuReading(index=1)]

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_ENGINE_TEST_HOOKS", "1")
    monkeypatch.setenv("FLEET_NVML_STANDIN", str(tmp_path / "nvml-{cluster}.json"))
    for region in (EAST, WEST):
        write_standin(tmp_path / f"nvml-{region}.json", GPUS)
    health = HealthConfig(probe_idle_s=0.5, probe_busy_s=0.5, nvml_interval_s=0.2)
    fleet = SimFleet(tmp_path / "home", [EAST, WEST], slots=2, cluster={"health": health})
    try:
        yield fleet.up()
    finally:
        fleet.down()


def corrupt(fleet: SimFleet, region: str, url: str) -> dict:
    """POST /debug/corrupt with the credentials the cluster's agent and gateway use."""
    config = ClusterConfig.load(fleet.local.dir / "clusters" / region / "cluster.yaml")
    sec = config.security
    r = httpx.post(
        f"{url}/debug/corrupt", headers=replica_headers(sec), verify=replica_verify(sec), timeout=5
    )
    return r.json()


def ready(fleet: SimFleet) -> list[tuple[str, str]]:
    return sorted(
        (p["cluster"], p["replica_id"]) for p in fleet.deployment(NAME)["placements"] if p["state"] == "ready"
    )


def nodes(fleet: SimFleet) -> dict[str, dict]:
    return {n["cluster"]: n for n in fleet.api("GET", "/v1/nodes").json()["items"]}


def test_wrong_answers_and_an_xid_cordon_nodes_and_the_work_moves(fleet: SimFleet, tmp_path: Path) -> None:
    began = time.time()
    marks: list[tuple[str, float]] = []

    def mark(what: str) -> None:
        marks.append((what, time.time() - began))

    fleet.deploy(NAME, 2, min_regions=2, engine_args={"cold_start": 0.2})
    wait_for(lambda: [c for c, _ in ready(fleet)] == [EAST, WEST], 60, 0.2, "one ready replica per cluster")
    mark("ready")
    wait_for(lambda: {c for c, n in nodes(fleet).items() if n["state"] == "healthy"} == {EAST, WEST}, 20, 0.2,
             "both nodes reported healthy")  # fmt: skip
    mark("nodes")
    (east_url,) = [p["url"] for p in fleet.deployment(NAME)["placements"] if p["cluster"] == EAST]
    gateways = [fleet.gateways[EAST], fleet.gateways[WEST]]
    load = Load(gateways, fleet.key, NAME, workers=2, pause_s=0.05).start()
    streams = Load(gateways, fleet.key, NAME, workers=2, max_tokens=24, extra={"stream": True}).start()
    try:
        load.served(10, what="load flowing")
        mark("load")
        corrupted_at = time.time()
        assert corrupt(fleet, EAST, east_url) == {"corrupt": True}
        wait_for(
            lambda: nodes(fleet)[EAST]["state"] in ("cordoned", "drained"), 20, 0.1, "east's node cordoned"
        )
        cordoned_at = time.time()
        wait_for(
            lambda: [c for c, _ in ready(fleet)] == [WEST, WEST], 30, 0.2, "east's capacity re-placed in west"
        )
        replaced_at = time.time()
        wait_for(lambda: nodes(fleet)[EAST]["state"] == "drained", 30, 0.2, "east's node drained")
        mark("drained")
        load.served(4, since=replaced_at, what="requests served after the re-placement")

        # an operator returns east's node; then a GPU of west's falls off the bus
        uncordon = f"/v1/nodes/{EAST}/{nodes(fleet)[EAST]['node']}/uncordon"
        assert fleet.api("POST", uncordon, json={"reason": "repaired"}).status_code == 200
        wait_for(lambda: nodes(fleet)[EAST]["state"] in ("remediated", "healthy"), 20, 0.2, "east remediated")
        mark("remediated")
        write_standin(
            tmp_path / f"nvml-{WEST}.json", [GPUS[0], GpuReading(index=1, xids=[XidEvent(code=79)])]
        )
        xid_at = time.time()
        mark("xid")
        wait_for(
            lambda: nodes(fleet)[WEST]["state"] in ("cordoned", "drained"), 20, 0.1, "west's node cordoned"
        )
        west_cordoned_at = time.time()
        mark("west cordoned")
        wait_for(
            lambda: [c for c, _ in ready(fleet)] == [EAST, EAST], 30, 0.2, "west's capacity re-placed in east"
        )
        moved_at = time.time()
        load.served(4, since=moved_at, what="requests served after the second move")
    finally:
        results = load.stop() + streams.stop()
    mark("moved")
    failed = [r for r in results if r.status != 200 or r.error]
    assert failed == [], (
        [(r.started - began, r.ended - began, r.gateway, r.status, r.error) for r in failed[:5]],
        marks,
    )
    # no new replica landed on the cordoned west node meanwhile
    assert all(c == EAST for c, _ in ready(fleet))
    listed = {n["cluster"]: n for n in fleetctl_json(fleet.home, "nodes", "ls")}
    assert listed[WEST]["state"] in ("cordoned", "drained") and listed[WEST]["failures"] >= 1
    assert "fell_off_bus" in listed[WEST]["reason"] or "Xid 79" in listed[WEST]["reason"]
    assert listed[EAST]["failures"] >= 1
    mark("listed")
    print(
        f"\nrequests {len(results)} ({len(streams.results)} streamed), failed {len(failed)}; corrupt -> cordoned {cordoned_at - corrupted_at:.1f} s,"
        f" -> re-placed {replaced_at - corrupted_at:.1f} s; XID -> cordoned {west_cordoned_at - xid_at:.1f} s,"
        f" -> moved {moved_at - xid_at:.1f} s; whole test {time.time() - began:.1f} s"
    )
    print("phases: " + ", ".join(f"{what} {t:.1f} s" for what, t in marks))
