"""Canary rollouts on a full fleet (every sim slot taken): the canary gets its GPUs by
replacing baseline replicas in place within max_unavailable. Real nats-server, control
plane, agent and gateway processes with simulated replicas under steady load. The ready
count is sampled over time and printed (pytest -s)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.e2e.sim_fleet import Load, SimFleet, wait_for
from tests.e2e.test_rollouts import fleetctl

REGION = "local-east"
NAME = "full"
REPLICAS = 4
SIM_ARGS = {"cold_start": 0.2, "max_num_seqs": 16}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = SimFleet(tmp_path_factory.mktemp("full-home"), [REGION], slots=REPLICAS)
    try:
        fleet.up()
        body = {"name": NAME, "model": "sim", "replicas": REPLICAS, "engine_args": SIM_ARGS}
        r = fleet.api("POST", "/v1/deployments", json=body)
        assert r.status_code == 201, r.text
        wait_for(lambda: fleet.ready_by_version(NAME).get(1) == REPLICAS, 60, 0.2, "the baseline's replicas")
        yield fleet
    finally:
        fleet.down()


class ReadyWatch:
    """Samples (time, ready replicas of any version) every 0.1 s."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.samples: list[tuple[float, int]] = []
        self.modes: set[str] = set()  # capacity_mode values the rollout status showed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), sum(self.fleet.ready_by_version(NAME).values())))
                last = rollout(self.fleet).get("last") or {}
                if last.get("capacity_mode"):
                    self.modes.add(f"{last['capacity_mode']}: {last.get('capacity_reason', '')}")
            except Exception:
                pass
            time.sleep(0.1)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

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
            time.sleep(0.5)
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
        "--steps", "10,30,60,100", "--step-duration", "2s", "--min-requests", "10",
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
