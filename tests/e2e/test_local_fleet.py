"""The whole fleet with real processes: nats-server, the control
plane, an agent and a gateway per region, and real SmolLM2 engine replicas, driven
through `fleetctl` and called with the `openai` SDK.

The tests share one fleet and run in file order: each step leaves the fleet in the
state the next one starts from.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from control_plane.local.fleet import MARKER_ENV, LocalFleet, pid_alive
from tests.e2e.sim_fleet import wait_for
from tests.fleetctl import fleetctl, fleetctl_json

ROOT = Path(__file__).resolve().parents[2]
REGIONS = ["local-east", "local-west"]
DEPLOYMENT = "smollm2"

pytestmark = pytest.mark.slow


class Fleet:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.local = LocalFleet(home)
        self.up: dict = {}
        self.key = ""

    @property
    def state(self):
        state = self.local.load()
        assert state is not None
        return state

    def process(self, kind: str, name: str | None = None):
        for record in self.state.processes:
            if record.kind == kind and (name is None or record.name == name):
                return record
        raise KeyError(kind, name)

    def gateway_urls(self) -> list[str]:
        return [c["gateway"] for c in self.up["clusters"]]

    def client(self, gateway: str, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key or self.key, max_retries=0, timeout=120)

    def status(self) -> dict:
        return fleetctl_json(self.home, "status", DEPLOYMENT)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_gguf):
    home = tmp_path_factory.mktemp("fleet-home")
    fleet = Fleet(home)
    try:
        fleet.up = fleetctl_json(home, "up", "--detach", "--regions", ",".join(REGIONS), timeout=300)
        yield fleet
    finally:
        state = fleet.local.load()
        fleetctl(home, "down", check=False, timeout=120)
        if state is not None:  # belt and braces: never leave processes behind
            for proc in fleet.local.marked_processes(state.fleet_id):
                proc.kill()


def chat(client: openai.OpenAI, stream: bool = False, max_tokens: int = 8):
    messages = [{"role": "user", "content": "Name one colour."}]
    if not stream:
        return client.chat.completions.create(
            model=DEPLOYMENT, messages=messages, max_tokens=max_tokens, temperature=0
        )
    chunks = list(
        client.chat.completions.create(
            model=DEPLOYMENT, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
    )
    return chunks


def test_up_deploy_and_serve_through_every_gateway(fleet: Fleet):
    ps = fleetctl_json(fleet.home, "ps")
    kinds = sorted({row["kind"] for row in ps})
    assert {"nats", "control-plane", "agent", "gateway"} <= set(kinds)
    assert all(row["pid"] and row["alive"] for row in ps)
    assert sum(row["kind"] == "gateway" for row in ps) == len(REGIONS)

    fleetctl_json(fleet.home, "deploy", DEPLOYMENT, "--model", "smollm2-135m", "--replicas", "2")
    status = wait_for(
        lambda: (s := fleet.status())["ready_replicas"] >= 2 and s, 300, 1.0, "2 ready replicas"
    )
    assert status["desired_replicas"] == 2
    assert len([p for p in status["placements"] if p["state"] == "ready"]) == 2

    fleet.key = fleetctl_json(fleet.home, "keys", "create", "e2e")["key"]
    # A new key reaches the gateways through NATS KV and the agents' state files: within
    # about a second, not at once.
    for gateway in fleet.gateway_urls():
        wait_for(lambda g=gateway: _key_accepted(g, fleet.key), 30, 0.2, f"the new key at {gateway}")
    for gateway in fleet.gateway_urls():
        client = fleet.client(gateway)
        reply = chat(client)
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
        chunks = chat(client, stream=True)
        text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert len(chunks) > 2 and text
        with pytest.raises(openai.AuthenticationError):
            fleet.client(gateway, key="fleet-nope-nope").chat.completions.create(
                model=DEPLOYMENT, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        response = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 401
        assert response.json()["error"]["message"]


def _key_accepted(gateway: str, key: str) -> bool:
    response = httpx.get(f"{gateway}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return response.status_code == 200


def _burst(fleet: Fleet, n: int, stream_every: int | None = 3) -> list[str]:
    """n requests spread over the gateways (every `stream_every`-th streamed; None: none);
    returns the errors."""
    gateways = fleet.gateway_urls()

    def one(i: int):
        client = fleet.client(gateways[i % len(gateways)])
        try:
            if stream_every and i % stream_every == 0:
                chunks = chat(client, stream=True)
                assert chunks
            else:
                assert chat(client).choices[0].message.content is not None
            return None
        except Exception as err:
            return f"request {i}: {type(err).__name__}: {err}"

    with cf.ThreadPoolExecutor(8) as pool:
        return [e for e in pool.map(one, range(n)) if e]


def _in_flight(fleet: Fleet) -> float:
    """Requests the gateways are handling now (their fleet_gateway_in_flight gauges)."""
    total = 0.0
    for url in fleet.gateway_urls():
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("fleet_gateway_in_flight{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _desired_replica_ids(fleet: Fleet) -> list[str]:
    return sorted(p["replica_id"] for p in fleet.status()["placements"])


def test_serving_survives_control_plane_death_and_converges_back(fleet: Fleet):
    before = _desired_replica_ids(fleet)
    cp = fleet.process("control-plane")
    os.kill(cp.pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(cp.pid), 10, 0.1, "control plane to die")
    errors = _burst(fleet, 40)
    assert errors == []

    port = int(cp.url.rsplit(":", 1)[1])
    state = fleet.state
    state.processes = [p for p in state.processes if p.kind != "control-plane"]
    fleet.local.save(state)
    fleet.local.start_control_plane(state, port=port)
    status = wait_for(lambda: (s := fleet.status())["ready_replicas"] >= 2 and s, 120, 1.0, "convergence")
    assert status["desired_replicas"] == 2
    assert _desired_replica_ids(fleet) == before  # nothing re-placed, nothing duplicated
    replicas = [r for r in fleet.local.ps() if r["kind"] == "replica" and r["alive"]]
    assert len(replicas) == 2


def test_agent_restart_without_nats_resumes_from_disk(fleet: Fleet):
    nats = fleet.process("nats")
    os.kill(nats.pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(nats.pid), 20, 0.1, "nats to stop")

    # Restart the agent of the region that runs replicas (or the first one).
    region = fleet.status()["placements"][0]["cluster"]
    agent = fleet.process("agent", region)
    os.kill(agent.pid, signal.SIGTERM)
    wait_for(lambda: not pid_alive(agent.pid), 60, 0.2, "agent to stop")
    state = fleet.state
    state.processes = [p for p in state.processes if p.pid != agent.pid]
    fleet.local.save(state)
    config = fleet.local.dir / "clusters" / region / "cluster.yaml"
    new_agent = fleet.local.spawn(
        state, "agent", region, [sys.executable, "-m", "agent", "--config", str(config)], config=str(config)
    )
    gateway = next(c["gateway"] for c in fleet.up["clusters"] if c["region"] == region)
    reply = wait_for(lambda: chat(fleet.client(gateway)), 300, 2.0, "serving without NATS")
    assert reply.choices[0].message.content is not None
    assert pid_alive(new_agent.pid)

    # NATS back (same port and store): heartbeats resume, the control plane sees the cluster.
    state = fleet.state
    state.processes = [p for p in state.processes if p.kind != "nats"]
    fleet.local.save(state)
    fleet.local.start_nats(state, port=int(nats.url.rsplit(":", 1)[1]))

    def heartbeat_fresh():
        clusters = {c["id"]: c for c in fleetctl_json(fleet.home, "clusters")}
        return clusters[region]["status"] == "healthy" and clusters[region]["last_heartbeat_at"]

    first = wait_for(heartbeat_fresh, 60, 1.0, "heartbeats after NATS restart")
    wait_for(lambda: heartbeat_fresh() != first, 30, 1.0, "heartbeat timestamps to advance")
    wait_for(lambda: fleet.status()["ready_replicas"] >= 2, 300, 1.0, "2 ready replicas again")


def test_replica_killed_under_load_is_restarted_and_no_unstarted_request_fails(fleet: Fleet):
    replicas = [r for r in fleet.local.ps() if r["kind"] == "replica" and r["alive"]]
    assert replicas
    victim = replicas[0]
    with cf.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_burst, fleet, 24, None)  # non-streamed: none has started streaming
        wait_for(lambda: _in_flight(fleet) > 0, 60, 0.05, "requests in flight at the gateways")
        os.kill(victim["pid"], signal.SIGKILL)
        errors = load.result(timeout=600)
    assert errors == []

    def restarted():
        status = fleet.status()
        return status["ready_replicas"] >= 2 and status

    wait_for(restarted, 300, 1.0, "replica restarted")
    alive = [r for r in fleet.local.ps() if r["kind"] == "replica" and r["alive"]]
    assert len(alive) == 2 and victim["pid"] not in {r["pid"] for r in alive}


def test_down_leaves_no_process_behind(fleet: Fleet):
    state = fleet.state
    pids = [r["pid"] for r in fleet.local.ps()]
    reports = fleetctl_json(fleet.home, "down", timeout=180)
    print("fleetctl down:", reports)
    assert {r["step"] for r in reports} >= {"gateways", "agents (draining replicas)", "control plane", "nats"}
    assert all(not pid_alive(pid) for pid in pids)
    leftovers = [p for p in psutil.process_iter() if _marked(p, state.fleet_id)]
    assert leftovers == []
    assert fleetctl_json(fleet.home, "ps") == []


def _marked(proc: psutil.Process, fleet_id: str) -> bool:
    try:
        return proc.environ().get(MARKER_ENV) == fleet_id
    except psutil.Error:
        return False


def test_foreground_up_stops_everything_on_ctrl_c(tmp_path):
    """`fleetctl up` without --detach: Ctrl-C (SIGINT) takes the whole fleet down."""
    env = {**os.environ, "FLEET_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", "up", "--regions", "local-solo"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    local = LocalFleet(tmp_path)
    try:
        wait_for(
            lambda: (
                (s := local.load())
                and {p.kind for p in s.processes} >= {"agent", "gateway"}
                and all(pid_alive(p.pid) for p in s.processes)
            ),
            120,
            0.5,
            "the fleet to start",
        )
        # The key is written just before the summary: then `up` enters its foreground loop.
        wait_for(lambda: (tmp_path / "local" / "inference-key").exists(), 120, 0.2, "up to finish")
        state = local.load()
        # Its loop rewrites the Prometheus targets file (a new inode each time) after it set its
        # signal handlers: a rewrite after `up`'s own write means the loop runs.
        wait_for(local.targets_path.exists, 60, 0.1, "up's Prometheus targets")
        first = local.targets_path.stat().st_ino
        wait_for(lambda: local.targets_path.stat().st_ino != first, 60, 0.1, "up's foreground loop")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "stopping the local fleet" in out
        assert all(not pid_alive(p.pid) for p in state.processes)
        assert local.marked_processes(state.fleet_id) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        fleetctl(tmp_path, "down", check=False)
