"""Autoscaling with real processes: nats-server, the control plane (autoscale
loop every 0.5 s), one agent with the `sim` runtime (simulated replicas, 1.5 s cold
start) and its gateway. A deployment with min 0 scales from zero on the first request
(which succeeds), up under concurrent load, and back to zero after the delay."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from control_plane.local.fleet import LocalFleet
from fleet_base.protocol import PoolInventory
from tests import polling

pytestmark = pytest.mark.slow

DEP = "auto"
COLD_START_S = 1.5


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    """`tests.polling.wait_for`, a component restarting meaning "not yet"."""
    return polling.wait_for(check, timeout, what, interval, retry_errors=True)


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("FLEET_HOME", str(tmp_path))
    monkeypatch.setenv("FLEET_AUTOSCALE_INTERVAL_S", "0.5")
    local = LocalFleet(tmp_path)
    state = local.new_state(["east"])
    local.save(state)
    try:
        local.start_nats(state)
        cp = local.start_control_plane(state)
        token_file = tmp_path / "admin-token"
        wait_for(
            lambda: httpx.get(f"{cp.url}/healthz", timeout=1).status_code == 200 and token_file.exists(),
            60,
            "the control plane",
        )
        config = local.write_cluster_config(state, "east", 0, 4, [])
        config = config.model_copy(update={
            "runtime": "sim",
            "pools": [PoolInventory(name="sim", gpu_model="cpu", gpus_per_node=4, nodes=1)],
            "gateway": config.gateway.model_copy(update={"cold_start_timeout_s": 60.0}),
        })  # fmt: skip
        config.dump(local.dir / "clusters" / "east" / "cluster.yaml")
        local.start_cluster(state, config)
        headers = {"authorization": f"Bearer {token_file.read_text().strip()}"}
        api = httpx.Client(base_url=cp.url, headers=headers, timeout=10)
        wait_for(
            lambda: any(c["status"] == "healthy" for c in api.get("/v1/clusters").json()["items"]),
            60,
            "the cluster's heartbeat",
        )
        gw = config.gateway.url
        wait_for(lambda: httpx.get(f"{gw}/health", timeout=2).status_code == 200, 60, "the gateway")
        key = api.post("/v1/keys", json={"name": "t", "scopes": ["inference"]}).json()["key"]
        yield api, gw, key
    finally:
        with contextlib.suppress(Exception):
            local.down(timeout=5)
        for proc in local.marked_processes(state.fleet_id):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def chat(gw: str, key: str, max_tokens: int = 60, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{gw}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={
            "model": DEP,
            "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": max_tokens,
        },
        timeout=timeout,
    )


def test_scale_from_zero_up_under_load_and_back_to_zero(fleet) -> None:
    api, gw, key = fleet
    body = {
        "name": DEP,
        "model": "llama2-70b",
        "engine_args": {"profile": "llama2-70b-h100-tp4", "cold_start": COLD_START_S},
        "gpu_count": 1,
        "replicas": 0,
        "min_replicas": 0,
        "max_replicas": 3,
        "scale_to_zero": True,
        "target_concurrency": 2,
        "autoscale_window_s": 4,
        "scale_down_delay_s": 2,
    }
    r = api.post("/v1/deployments", json=body)
    assert r.status_code == 201, r.text
    # A scaled-to-zero deployment keeps its route: the gateway knows it.
    wait_for(lambda: DEP in httpx.get(f"{gw}/health").json()["routes"], 30, "the route of a zero deployment")
    assert api.get(f"/v1/deployments/{DEP}").json()["desired_replicas"] == 0

    # 1. The first request waits for a cold start and succeeds.
    t0 = time.monotonic()
    first = chat(gw, key, max_tokens=5)
    took = time.monotonic() - t0
    assert first.status_code == 200, first.text
    assert first.json()["system_fingerprint"] == "simulated"
    assert took >= COLD_START_S
    events = api.get("/v1/events", params={"deployment": DEP, "kind": "scaled"}).json()["items"]
    assert any("scale from zero" in e["message"] for e in events)
    metrics = httpx.get(f"{gw}/metrics").text
    cold = [
        float(v)
        for v in re.findall(r'fleet_agent_cold_start_seconds\{deployment="auto",[^}]*\} (\S+)', metrics)
    ]
    assert cold and all(COLD_START_S <= c < 30 for c in cold)
    print(f"\nfirst request from zero: {took:.2f} s (replica cold start {cold[0]:.2f} s)")

    # 2. Concurrent load: 8 requests in flight for target 2 x 0.7 per replica -> max 3.
    stop = threading.Event()
    codes: list[int] = []

    def worker() -> None:
        while not stop.is_set():
            codes.append(chat(gw, key, max_tokens=80).status_code)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    t_load = time.monotonic()
    try:
        wait_for(
            lambda: api.get(f"/v1/deployments/{DEP}").json()["desired_replicas"] == 3, 30, "scale-up to 3"
        )
        print(f"load -> 3 replicas wanted after {time.monotonic() - t_load:.1f} s")
        wait_for(
            lambda: sum(p["state"] == "ready" for p in api.get(f"/v1/deployments/{DEP}").json()["placements"]) == 3,
            30, "3 ready replicas",
        )  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert codes and set(codes) == {200}

    # 3. Idle: down after the window, the delay and the grace, to zero.
    t_idle = time.monotonic()
    wait_for(
        lambda: api.get(f"/v1/deployments/{DEP}").json()["desired_replicas"] == 0,
        60,
        "scale-down to zero",
        0.5,
    )
    assert time.monotonic() - t_idle >= 2  # not before the scale-down delay
    print(f"idle -> 0 replicas after {time.monotonic() - t_idle:.1f} s")
    messages = [
        e["message"]
        for e in api.get("/v1/events", params={"deployment": DEP, "kind": "scaled"}).json()["items"]
    ]
    assert any("scale to zero" in m for m in messages)
    wait_for(lambda: not api.get(f"/v1/deployments/{DEP}").json()["placements"], 30, "replicas stopped")
    # Still routed at zero; a new request would scale it from zero again.
    assert DEP in httpx.get(f"{gw}/health").json()["routes"]
