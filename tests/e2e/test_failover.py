"""Active-active failover end to end: two regions, a deployment
with min_regions 2 serving from both, steady non-streaming load through both gateways;
kill -9 one region's agent and replicas. Zero requests may fail, and the time until all
traffic flows to the surviving region is measured (the last attempt the dead region's
gateway sent to a dead target, read from its upstream-error counter). Then NATS dies:
a partitioned fleet keeps serving from cached state. Figures are printed (pytest -s)."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.e2e.sim_fleet import Load, Sampler, SimFleet, wait_for

EAST, WEST = "local-east", "local-west"
NAME = "web"

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path):
    fleet = SimFleet(tmp_path / "home", [EAST, WEST], slots=3)
    try:
        yield fleet.up()
    finally:
        fleet.down()


class CounterWatch(Sampler):
    """Polls one gateway counter; remembers when it last grew."""

    interval = 0.05

    def __init__(self, fleet: SimFleet, region: str, metric: str, **labels: str) -> None:
        self.args = (region, metric)
        self.labels = labels
        self.fleet = fleet
        self.last_growth: float | None = None
        self.value = fleet.gateway_metric(region, metric, **labels)
        self.start()

    def sample(self) -> None:
        value = self.fleet.gateway_metric(*self.args, **self.labels)
        if value > self.value:
            self.value, self.last_growth = value, time.time()


def ready_clusters(fleet: SimFleet) -> list[str]:
    return sorted(p["cluster"] for p in fleet.deployment(NAME)["placements"] if p["state"] == "ready")


def test_losing_a_region_fails_no_request_and_traffic_moves_within_3s(fleet: SimFleet):
    fleet.deploy(NAME, 2, min_regions=2, engine_args={"cold_start": 0.2})
    wait_for(lambda: ready_clusters(fleet) == [EAST, WEST], 60, 0.2, "one ready replica per region")
    # both gateways know the whole route (each region serves, each can forward to the other)
    wait_for(lambda: fleet.gateway_metric(EAST, "fleet_gateway_requests_total") >= 0, 5)
    load = Load([fleet.gateways[EAST], fleet.gateways[WEST]], fleet.key, NAME, workers=4).start()
    errors = CounterWatch(fleet, EAST, "fleet_gateway_upstream_errors_total", deployment=NAME)
    try:
        wait_for(lambda: {x.cluster for x in load.results if x.status == 200} >= {EAST, WEST}, 30, 0.05,
                 "traffic served in both regions")  # fmt: skip
        served_east_before = sum(1 for x in load.results if x.cluster == EAST)
        killed_at = time.time()
        fleet.kill_region(EAST)
        # the control plane declares east unhealthy and re-places its replica in west
        wait_for(
            lambda: [p["cluster"] for p in fleet.deployment(NAME)["placements"] if p["state"] == "ready"]
            == [WEST, WEST],
            40, 0.2, "east's replica re-placed in west",
        )  # fmt: skip
        replaced_at = time.time()
        load.served(4, since=replaced_at, what="requests served after the re-placement")
    finally:
        results = load.stop()
        errors.stop()
    after = [x for x in results if x.started >= killed_at]
    east_after = [x for x in after if x.cluster == EAST]
    moved_s = (
        (errors.last_growth - killed_at) if errors.last_growth and errors.last_growth >= killed_at else 0.0
    )
    slowest = max((x.ended - x.started for x in after), default=0.0)
    print(
        f"\n[failover] {len(results)} requests through both gateways, {len(load.failed())} failed; "
        f"{served_east_before} served in east before the kill, {len(east_after)} after it\n"
        f"[failover] all traffic on {WEST} {moved_s:.2f}s after kill -9 (last attempt at a dead target); "
        f"slowest request after the kill {slowest:.2f}s; east's replica re-placed in west after "
        f"{replaced_at - killed_at:.1f}s"
    )
    assert served_east_before > 0
    assert load.failed() == [], load.failed()[:3]
    assert east_after == []
    assert moved_s <= 3.0

    # A partition: NATS gone. Both gateways serve from cached routes and replicas.
    nats = fleet.process("nats")
    psutil.Process(nats.pid).kill()
    partitioned_at = time.time()
    load = Load([fleet.gateways[EAST], fleet.gateways[WEST]], fleet.key, NAME, workers=2).start()
    load.served(20, since=partitioned_at, what="requests through both gateways without NATS")
    results = load.stop()
    print(f"[partition] NATS killed: {len(results)} requests, {len(load.failed())} failed")
    assert results and load.failed() == []


def test_standby_region_serves_only_while_the_primary_is_down(fleet: SimFleet):
    fleet.deploy(NAME, 1, standby_regions=[WEST], engine_args={"cold_start": 0.2})
    wait_for(lambda: ready_clusters(fleet) == [EAST, WEST], 60, 0.2, "the primary and the warm standby")
    # routes (with the standby flag) reached both gateways: west's forwards to the primary
    wait_for(lambda: fleet.served_by(WEST, NAME) == EAST, 30, 0.2, "west's gateway forwarding to the primary")
    load = Load([fleet.gateways[EAST], fleet.gateways[WEST]], fleet.key, NAME, workers=4).start()
    try:
        wait_for(lambda: len(load.results) >= 8, 30, 0.05, "traffic to the primary")
        killed_at = time.time()
        fleet.kill_region(EAST)
        # the standby serves, and keeps serving past the 3 s the assertions below allow
        wait_for(lambda: any(x.cluster == WEST and x.started > killed_at + 3.0 for x in load.results),
                 30, 0.05, "the standby serving after the kill")  # fmt: skip
    finally:
        results = load.stop()
    before = [x for x in results if x.ended < killed_at]
    after = [x for x in results if x.started > killed_at]
    first_west = min((x.ended for x in after if x.cluster == WEST), default=float("nan"))
    late_east = [x for x in after if x.cluster == EAST and x.started > killed_at + 3.0]
    print(
        f"\n[standby] {len(results)} requests, {len(load.failed())} failed; before the kill "
        f"{sum(x.cluster == EAST for x in before)}/{len(before)} served by the primary; standby serving "
        f"{first_west - killed_at:.2f}s after kill -9"
    )
    assert before and all(x.cluster == EAST for x in before)  # the standby took nothing
    assert load.failed() == [], load.failed()[:3]
    assert after and not late_east and any(x.cluster == WEST for x in after)
