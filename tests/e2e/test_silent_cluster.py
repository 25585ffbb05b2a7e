"""An agent that stands still past the failover limit (SIGSTOP: its heartbeats stop, while
its gateway and replicas live on, as in a long GC pause or a starved node), in a fleet with
nowhere else to put its replicas. The control plane marks the cluster unhealthy and drops
its routes, but holds its replicas in the desired state the agent reads on resuming: the
same replica processes serve on and nothing is restarted (real processes: nats-server,
control plane, agent with the sim runtime, its gateway)."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.e2e.sim_fleet import SimFleet, wait_for

EAST = "local-east"
NAME = "web"

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path):
    fleet = SimFleet(tmp_path / "home", [EAST], slots=2)
    try:
        yield fleet.up()
    finally:
        fleet.down()


def _status(fleet: SimFleet) -> str:
    return next(c["status"] for c in fleet.api("GET", "/v1/clusters").json()["items"] if c["id"] == EAST)


def _events(fleet: SimFleet, kind: str) -> list[dict]:
    return fleet.api("GET", "/v1/events", params={"kind": kind}).json()["items"]


def _replicas(fleet: SimFleet) -> dict[str, int]:
    """Replica -> pid of every replica process the agent runs."""
    return {r.name: r.pid for r in fleet.local.replicas(fleet.local.load())}


def _serves(fleet: SimFleet) -> bool:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{fleet.gateways[EAST]}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {fleet.key}"},
        timeout=30,
    )
    return r.status_code == 200


def test_an_agent_that_stood_still_gets_back_every_replica_it_ran(fleet: SimFleet) -> None:
    fleet.deploy(NAME, 2, engine_args={"cold_start": 0.2})
    fleet.wait_ready(NAME, 2)
    before = _replicas(fleet)
    assert len(before) == 2 and _serves(fleet)
    shortfalls = len(_events(fleet, "placement_short"))

    agent = psutil.Process(fleet.process("agent", EAST).pid)
    agent.suspend()
    try:
        wait_for(lambda: _status(fleet) == "unhealthy", 30, 0.2, "the silent cluster to be failed over")
        # a reconcile has run on the failover: what it published is what the agent reads next
        wait_for(lambda: len(_events(fleet, "placement_short")) > shortfalls, 30, 0.2, "the re-placement")
        states = {p["state"] for p in fleet.deployment(NAME)["placements"]}
        assert states == {"unreachable"}, states
    finally:
        agent.resume()

    wait_for(lambda: _status(fleet) == "healthy", 30, 0.2, "the cluster to be heard again")
    fleet.wait_ready(NAME, 2)
    assert _replicas(fleet) == before  # the same processes: none stopped, none started
    assert all(psutil.pid_exists(pid) for pid in before.values())
    assert not _events(fleet, "removed")
    assert _serves(fleet)
