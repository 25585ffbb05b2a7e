"""SLO-driven autoscaling with real processes: nats-server, the control plane (autoscale
loop every 0.5 s), one agent with the `sim` runtime (replicas timed by the Llama2-70B H100
profile) and its gateway. Four clients keep four requests in flight throughout; when
their prompts grow from a dozen tokens to ~15,000 the work per request grows ~1000x while the
concurrency stays put: the default policy scales up on the work, and the previous
concurrency policy, fed the same in-flight counts, stays at one replica."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from control_plane.autoscale import AutoscaleSettings, Observation, ScalerState, make_policy
from tests.e2e.sim_fleet import SimFleet, wait_for

pytestmark = pytest.mark.slow

DEP = "work"
CLIENTS = 4


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.setenv("FLEET_AUTOSCALE_INTERVAL_S", "0.5")
    f = SimFleet(tmp_path, ["east"], slots=4)
    try:
        yield f.up()
    finally:
        f.down()


class Clients:
    """CLIENTS threads, each one request at a time: constant concurrency."""

    def __init__(self, gw: str, key: str) -> None:
        self.gw, self.key = gw, key
        self.words = 6
        self.stop = threading.Event()
        self.codes: list[int] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(CLIENTS)]

    def _run(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                r = http.post(
                    f"{self.gw}/v1/chat/completions",
                    headers={"authorization": f"Bearer {self.key}"},
                    json={
                        "model": DEP,
                        "messages": [{"role": "user", "content": "tokens " * self.words}],
                        "max_tokens": 20,
                    },
                )
                self.codes.append(r.status_code)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def test_prompt_length_shift_at_constant_concurrency_scales_up(fleet: SimFleet) -> None:
    body = {
        "name": DEP,
        "model": "llama2-70b",
        "engine_args": {"profile": "llama2-70b-h100-tp4", "cold_start": 1.0},
        "gpu_count": 1,
        "min_replicas": 1,
        "max_replicas": 4,
        "target_concurrency": 16,
        "autoscale_window_s": 4,
        "scale_down_delay_s": 60,
        "slo_ttft_s": 2.0,
        "slo_itl_s": 0.1,
    }
    r = fleet.api("POST", "/v1/deployments", json=body)
    assert r.status_code == 201, r.text
    version = fleet.deployment(DEP)["versions"][-1]
    assert (version["slo_ttft_s"], version["slo_itl_s"]) == (2.0, 0.1)
    wait_for(lambda: fleet.ready_by_version(DEP).get(1) == 1, 60, 0.2, "the first replica")

    with Clients(fleet.gateways["east"], fleet.key) as clients:
        # Short prompts: four in flight is light work for one replica.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8:
            assert fleet.deployment(DEP)["desired_replicas"] == 1
            time.sleep(0.5)
        # The same four clients, prompts of ~15,000 tokens (prefill ~1.6 s each on this profile).
        clients.words = 9000
        shifted = time.monotonic()
        wait_for(lambda: fleet.deployment(DEP)["desired_replicas"] >= 2, 45, 0.5, "a scale-up on the work")
        print(f"\nprompt shift -> {fleet.deployment(DEP)['desired_replicas']} replicas after "
              f"{time.monotonic() - shifted:.1f} s")  # fmt: skip
    assert clients.codes and set(clients.codes) == {200}

    events = fleet.api("GET", "/v1/events", params={"deployment": DEP, "kind": "scaled"}).json()["items"]
    up = [e for e in events if "prompt" in e["message"] and "1 -> " in e["message"]]
    assert up, [e["message"] for e in events]
    decision = json.loads(up[-1]["message"][up[-1]["message"].index("{") :])
    assert decision["desired"] >= 2 and decision["predicted"]["prompt_tokens_per_s"] > 2000

    # The previous default, fed what it sees (requests in flight: four, before and after),
    # with this deployment's settings, never leaves one replica.
    s = AutoscaleSettings(min_replicas=1, max_replicas=4, target_concurrency=16, stable_window_s=4,
                          panic_window_s=1, scale_down_delay_s=60)  # fmt: skip
    old, state = make_policy("concurrency"), ScalerState()
    wants = {
        old.decide(
            s, state, Observation(at=t / 2, in_flight=CLIENTS - q, queued=q, ready=1, current=1)
        ).desired
        for t in range(120)
        for q in (0, 3)
    }
    assert wants == {1}
