"""Canary rollouts end to end: real nats-server,
control plane, agent and gateway processes with simulated replicas under steady load,
driven through `fleetctl rollout`.

1. a bad canary (30% errors) is rolled back automatically; the share of requests that
   reached it stays within the first step's weight plus one step's worth;
2. a good canary is promoted through every step with zero failed requests, and the
   fleet never holds more than the baseline plus one step's canary replicas;
4. the control plane killed mid-rollout resumes it where it was.
The tests share one fleet and run in file order. Figures are printed (pytest -s)."""

from __future__ import annotations

import time

import pytest

from tests.control_plane.cp_server import SHORT_LEASE_ENV
from tests.e2e.sim_fleet import Load, Sampler, SimFleet, serving_fleet, wait_for
from tests.fleetctl import fleetctl

REGION = "local-east"
NAME = "web"
REPLICAS = 4
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    home = tmp_path_factory.mktemp("rollout-home")
    with serving_fleet(
        home, REGION, NAME, REPLICAS, REPLICAS + 2, control_plane_env=SHORT_LEASE_ENV, engine_args=SIM_ARGS
    ) as fleet:
        yield fleet


def rollout(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


class GpuWatch(Sampler):
    """Samples the GPUs assigned to the deployment (every placement, any state)."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, sum(p["gpus"] for p in self.fleet.deployment(NAME)["placements"]))


def choices(fleet: SimFleet) -> dict[str, float]:
    return {
        v: fleet.gateway_metric(REGION, "fleet_gateway_replica_choice_total", deployment=NAME, version=v)
        for v in ("1", "2")
    }


def test_bad_canary_is_rolled_back_automatically(fleet: SimFleet):
    before = choices(fleet)
    load = Load([fleet.gateways[REGION]], fleet.key, NAME, workers=4).start()
    started = time.time()
    try:
        time.sleep(0.5)
        fleetctl(
            fleet.home, "rollout", "start", NAME, "-e", "error_rate=0.3", "-e", "cold_start=0.2",
            "-e", "max_num_seqs=16", "--steps", "10,50,100", "--step-duration", "3s",
            "--max-error-rate", "0.05", "--min-requests", "20",
        )  # fmt: skip
        done = wait_for(
            lambda: (r := rollout(fleet))["phase"] == "rolled_back" and r, 40, 0.1, "the rollback"
        )
        rolled_back_at = time.time()
        wait_for(lambda: 2 not in fleet.ready_by_version(NAME), 60, 0.1, "the canary's replicas to go")
        time.sleep(0.5)
    finally:
        results = load.stop()
    after = choices(fleet)
    canary = after["2"] - before["2"]
    total = sum(after.values()) - sum(before.values())
    during = [r for r in results if r.started <= rolled_back_at]
    share = canary / total
    print(
        f"\n[bad canary] rolled back {rolled_back_at - started:.1f}s after the load began: {done['reason']}\n"
        f"[bad canary] {len(results)} requests ({len(during)} until the rollback), {int(total)} replica attempts, "
        f"{int(canary)} on the bad version = {share:.1%} (first step 10%); client-visible failures: "
        f"{len(load.failed())}; numbers: {done['last']}"
    )
    assert "error rate" in done["reason"] and done["step"] == 1
    assert share <= 0.10 + 0.10, share  # the first step's weight plus one step's worth
    assert fleet.deployment(NAME)["current_version"] == 1
    fleet.wait_versions(NAME, {1: REPLICAS}, 60, "the baseline back at full size")
    events = fleet.api("GET", "/v1/events", params={"deployment": NAME, "kind": "rollout_rolled_back"}).json()
    assert events["items"] and "canary_error_rate=" in events["items"][0]["message"]


def test_good_canary_is_promoted_without_failed_requests(fleet: SimFleet):
    load = Load([fleet.gateways[REGION]], fleet.key, NAME, workers=4).start()
    try:
        with GpuWatch(fleet) as gpus:
            out = fleetctl(
                fleet.home, "rollout", "start", NAME, "-e", "seed=2", "-e", "cold_start=0.2", "-e", "max_num_seqs=16", "--steps", "10,50,100", "--step-duration", "2s",
                "--min-requests", "10", "-o", "json",
            )  # fmt: skip
            assert '"canary_version": 3' in out.stdout
            wait_for(lambda: rollout(fleet)["phase"] != "deploying", 20, 0.1, "the first step")
            ro = wait_for(
                lambda: (r := rollout(fleet))["phase"] in ("promoted", "rolled_back") and r,
                60,
                0.2,
                "the end",
            )
            assert ro["phase"] == "promoted", f"{ro['reason']}: {ro['last']}"
            fleet.wait_versions(NAME, {3: REPLICAS}, 60, "the baseline to go")
    finally:
        results = load.stop()
    print(
        f"\n[good canary] {ro['phase']} ({ro['reason']}); {len(results)} requests, {len(load.failed())} failed; "
        f"peak GPUs {gpus.peak} (baseline {REPLICAS}, canary at most {REPLICAS})"
    )
    assert load.failed() == [], load.failed()[:3]
    # capacity follows weights: never the baseline plus the whole canary, at most one step's surge
    assert REPLICAS <= gpus.peak <= REPLICAS + 2
    assert fleet.deployment(NAME)["current_version"] == 3
    status = fleetctl(fleet.home, "rollout", "status", NAME).stdout
    assert "promoted" in status


def test_control_plane_restarted_mid_rollout_resumes_it(fleet: SimFleet):
    r = fleet.api(
        "POST",
        f"/v1/deployments/{NAME}/rollouts",
        json={
            "spec": {"engine_args": {**SIM_ARGS, "seed": 4}},
            "steps": [50, 100],
            "step_duration_s": 12,
            "min_requests": 5,
        },
    )  # fmt: skip  (a step longer than a secured control plane's restart on a busy box, so it resumes mid-step)
    assert r.status_code == 201, r.text
    load = Load([fleet.gateways[REGION]], fleet.key, NAME, workers=2).start()
    try:
        before = wait_for(lambda: (x := rollout(fleet))["phase"] == "observing" and x, 20, 0.1, "step 1")
        port = fleet.kill_control_plane()
        time.sleep(1.0)
        fleet.start_control_plane(port=port)
        resumed = rollout(fleet)
        assert (resumed["id"], resumed["step"], resumed["canary_version"]) == (before["id"], 1, 4)
        assert resumed["phase"] in ("observing", "deploying", "promoted")  # never back to a fresh start
        ro = wait_for(
            lambda: (x := rollout(fleet))["phase"] in ("promoted", "rolled_back") and x, 90, 0.2, "the end"
        )
    finally:
        results = load.stop()
    kinds = [
        e["kind"]
        for e in fleet.api("GET", "/v1/events", params={"deployment": NAME, "limit": 200}).json()["items"]
    ]
    print(f"\n[restart] resumed at step {resumed['step']} ({resumed['phase']}), ended {ro['phase']}; "
          f"{len(results)} requests, {len(load.failed())} failed")  # fmt: skip
    assert ro["phase"] == "promoted", ro
    assert "rollout_resumed" in kinds
    assert len(fleet.api("GET", f"/v1/deployments/{NAME}/rollouts").json()["items"]) == 3
    assert load.failed() == []
