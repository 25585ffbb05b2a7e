"""A full fleet (every sim slot taken), one fleet for the module: canary rollouts get
their GPUs by replacing baseline replicas in place within max_unavailable, then a
`critical` deployment takes slots from a `batch` one. Real nats-server, control plane,
agent and gateway processes with simulated replicas under steady load; the placer is
the default, the MILP (priorities and preemption are part of its model,
docs/placement.md). The ready count is sampled over time and printed (pytest -s)."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.sim_fleet import Load, Sampler, SimFleet, serving_fleet, wait_for
from tests.e2e.test_rollouts import REGION, REPLICAS, SIM_ARGS
from tests.fleetctl import fleetctl

NAME = "full"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    old = os.environ.pop("FLEET_PLACER", None)  # the default placer (milp) in the control plane process
    try:
        with serving_fleet(
            tmp_path_factory.mktemp("full-home"), REGION, NAME, REPLICAS, REPLICAS, engine_args=SIM_ARGS
        ) as fleet:
            yield fleet
    finally:
        if old is None:
            os.environ.pop("FLEET_PLACER", None)
        else:
            os.environ["FLEET_PLACER"] = old


class ReadyWatch(Sampler):
    """Samples (time, ready replicas of any version) every 0.1 s."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, int]] = []
        self.modes: set[str] = set()  # capacity_mode values the rollout status showed

    def sample(self) -> None:
        self.samples.append((time.time(), sum(self.fleet.ready_by_version(NAME).values())))
        last = rollout(self.fleet).get("last") or {}
        if last.get("capacity_mode"):
            self.modes.add(f"{last['capacity_mode']}: {last.get('capacity_reason', '')}")

    def log(self) -> str:
        t0 = self.samples[0][0] if self.samples else 0.0
        changes = [s for i, s in enumerate(self.samples) if i == 0 or s[1] != self.samples[i - 1][1]]
        return " ".join(f"{t - t0:.1f}s:{n}" for t, n in changes)


def rollout(fleet: SimFleet) -> dict:
    return fleet.api("GET", f"/v1/deployments/{NAME}/rollouts/current").json()


def _run_rollout(fleet: SimFleet, *args: str) -> tuple[dict, ReadyWatch, Load]:
    load = Load([fleet.gateways[REGION]], fleet.key, NAME, workers=3).start()
    try:
        with ReadyWatch(fleet) as watch:
            load.served(4, what="the load under way")
            fleetctl(fleet.home, "rollout", "start", NAME, *args)
            ro = wait_for(
                lambda: (r := rollout(fleet))["phase"] in ("promoted", "rolled_back") and r,
                120,
                0.2,
                "the end",
            )
            wait_for(lambda: len(fleet.ready_by_version(NAME)) == 1, 60, 0.2, "one version left")
            wait_for(lambda: sum(fleet.ready_by_version(NAME).values()) == REPLICAS, 60, 0.2, "full size")
    finally:
        load.stop()
    return ro, watch, load


def test_good_canary_is_promoted_by_replacement(fleet: SimFleet):
    ro, watch, load = _run_rollout(
        fleet, "-e", "seed=2", "-e", "cold_start=0.2", "-e", "max_num_seqs=16",
        "--steps", "25,50,100", "--step-duration", "2s", "--min-requests", "10",
        "--max-ttft-p90-ratio", "3",  # replacement, not the latency guard, is under test: cold canaries on a busy box
    )  # fmt: skip
    ready = [n for _, n in watch.samples]
    print(f"\n[full, good] {ro['phase']}: {ro['reason']}; {len(load.results)} requests, "
          f"{len(load.failed())} failed; ready over time: {watch.log()}")  # fmt: skip
    assert ro["phase"] == "promoted", ro
    assert load.failed() == [], load.failed()[:3]
    assert min(ready) >= REPLICAS - 1, watch.log()  # max_unavailable 25% of 4 = 1
    print("[full, good] rollout status said:\n  " + "\n  ".join(sorted(watch.modes)))
    assert any(m.startswith("replace: ") and "drained for the canary" in m for m in watch.modes), watch.modes


def test_bad_canary_is_rolled_back_and_the_baseline_restored(fleet: SimFleet):
    ro, watch, load = _run_rollout(
        fleet, "-e", "error_rate=0.5", "-e", "cold_start=0.2", "-e", "max_num_seqs=16",
        "--steps", "25,100", "--step-duration", "3s", "--max-error-rate", "0.05", "--min-requests", "20",
    )  # fmt: skip
    print(f"\n[full, bad] {ro['phase']}: {ro['reason']}; {len(load.results)} requests, "
          f"{len(load.failed())} failed; ready over time: {watch.log()}")  # fmt: skip
    assert ro["phase"] == "rolled_back", ro
    assert min(n for _, n in watch.samples) >= REPLICAS - 1, watch.log()
    assert fleet.ready_by_version(NAME) == {2: REPLICAS}  # version 2 was the promoted good canary


def _reconcile_passes(fleet: SimFleet) -> float:
    """Successful reconcile passes of the control plane so far."""
    text = fleet.api("GET", "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "fleet_control_plane_reconcile_duration_seconds":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise AssertionError("no reconcile stats on /metrics")


def test_critical_scale_up_takes_slots_from_batch(fleet: SimFleet):
    r = fleet.api("DELETE", f"/v1/deployments/{NAME}")  # free the slots the rollouts used
    assert r.status_code == 200, r.text
    wait_for(lambda: fleet.api("GET", f"/v1/deployments/{NAME}").status_code == 404, 30, 0.2, "the deletion")
    fleet.deploy("train", 4, engine_args=SIM_ARGS, priority="batch")
    fleet.wait_ready("train", 4)
    load = Load([fleet.gateways[REGION]], fleet.key, "train", workers=3).start()
    try:
        load.served(4, what="the batch load under way")
        fleet.deploy("chat", 2, engine_args=SIM_ARGS, priority="critical")
        fleet.wait_ready("chat", 2)
        load.served(4, since=time.time(), what="batch requests after the preemption")
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
    # Passes are serial: of two that end after the write, the second began after it and placed
    # the new size. A preemption of chat would be written in that pass (no guessed delay).
    passes = _reconcile_passes(fleet)
    wait_for(lambda: _reconcile_passes(fleet) >= passes + 2, 30, 0.1, "a reconcile pass after the scale-up")
    assert fleet.ready_by_version("chat").get(1) == 2
    chat_preempted = fleet.api("GET", "/v1/events", params={"deployment": "chat", "kind": "preempted"})
    assert chat_preempted.json()["items"] == []
