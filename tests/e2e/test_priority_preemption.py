"""Priorities on a full sim fleet: a `critical` deployment's replicas take slots from a
`batch` one, under load on the batch deployment, with no client-visible failures (the
preempted replicas drain; the gateway moves requests to the rest). Real processes,
first-fit-decreasing placer (the one that models priorities; docs/placement.md)."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.sim_fleet import Load, SimFleet, wait_for

REGION = "local-east"
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    old = os.environ.get("FLEET_PLACER")
    os.environ["FLEET_PLACER"] = "ffd"  # inherited by the control plane process
    fleet = SimFleet(tmp_path_factory.mktemp("prio-home"), [REGION], slots=4)
    try:
        fleet.up()
        yield fleet
    finally:
        fleet.down()
        if old is None:
            os.environ.pop("FLEET_PLACER", None)
        else:
            os.environ["FLEET_PLACER"] = old


def test_critical_scale_up_takes_slots_from_batch(fleet: SimFleet):
    body = {"name": "train", "model": "sim", "replicas": 4, "engine_args": SIM_ARGS, "priority": "batch"}
    assert fleet.api("POST", "/v1/deployments", json=body).status_code == 201
    wait_for(lambda: fleet.ready_by_version("train").get(1) == 4, 60, 0.2, "batch replicas")
    load = Load([fleet.gateways[REGION]], fleet.key, "train", workers=3).start()
    try:
        time.sleep(1.0)
        body = {
            "name": "chat",
            "model": "sim",
            "replicas": 2,
            "engine_args": SIM_ARGS,
            "priority": "critical",
        }
        assert fleet.api("POST", "/v1/deployments", json=body).status_code == 201
        wait_for(lambda: fleet.ready_by_version("chat").get(1) == 2, 60, 0.2, "critical replicas")
        time.sleep(1.0)
    finally:
        results = load.stop()
    events = fleet.api("GET", "/v1/events", params={"deployment": "train", "kind": "preempted"}).json()[
        "items"
    ]
    print(f"\n[priority] {len(results)} batch requests, {len(load.failed())} failed; "
          f"batch ready {fleet.ready_by_version('train')}; preemptions: {[e['message'] for e in events]}")  # fmt: skip
    assert len(events) == 2 and all(
        "(batch) preempted" in e["message"] and "chat" in e["message"] for e in events
    )
    assert fleet.ready_by_version("train").get(1, 0) == 2
    assert load.failed() == [], load.failed()[:3]
    # never the reverse: scaling the batch deployment back up takes nothing from critical
    r = fleet.api(
        "PATCH", "/v1/deployments/train", json={"replicas": 4, "min_replicas": 4, "max_replicas": 4}
    )
    assert r.status_code == 200, r.text
    time.sleep(2.0)
    assert fleet.ready_by_version("chat").get(1) == 2
