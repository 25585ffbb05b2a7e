"""The daemon's bookkeeping in-process with a scripted runtime (no processes, no NATS):
crash backoff, refused specs, adoption from runtime.json, the state_dir lock, and the
CLI's refusal of a bad config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.daemon import Agent, AgentLocked
from agent.replica import RuntimeFile
from agent.runtime.base import InvalidSpec, Probe, ReplicaHandle, Runtime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.protocol import DesiredState, ReplicaSpec, ReplicaState
from tests.agent.conftest import ROOT, cluster_config


class ScriptedRuntime(Runtime):
    """Replicas whose fate the test decides: `states[replica_id]` is what poll reports."""

    name = "scripted"

    def __init__(self) -> None:
        self.states: dict[str, ReplicaState] = {}
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.adoptable: set[int] = set()
        self._pid = 1000

    async def start(self, spec: ReplicaSpec) -> ReplicaHandle:
        if spec.engine_args.get("bad"):
            raise InvalidSpec("bad is not a flag")
        self._pid += 1
        self.started.append(spec.replica_id)
        self.states[spec.replica_id] = ReplicaState.starting
        return ReplicaHandle(
            replica_id=spec.replica_id, spec=spec, url=f"http://x:{self._pid}", pid=self._pid
        )

    async def poll(self, handle: ReplicaHandle) -> Probe:
        state = self.states[handle.replica_id]
        return Probe(state=state, exit_code=1 if state == ReplicaState.failed else None, error="boom")

    async def stop(self, handle: ReplicaHandle, drain_timeout_s: float) -> int | None:
        self.stopped.append(handle.replica_id)
        return 0

    async def kill(self, handle: ReplicaHandle) -> None:
        self.stopped.append(handle.replica_id)

    async def adopt(self, handle: ReplicaHandle) -> bool:
        return handle.pid in self.adoptable


def spec(rid: str, **engine_args: object) -> ReplicaSpec:
    return ReplicaSpec(replica_id=rid, deployment="d", version=1, model="m", engine_args=engine_args)


@pytest.fixture
def config(tmp_path: Path) -> ClusterConfig:
    return cluster_config(tmp_path, "nats://127.0.0.1:1")


async def test_crashes_back_off_exponentially_and_refused_specs_stay_failed(
    config: ClusterConfig,
) -> None:
    rt = ScriptedRuntime()
    clock = [1000.0]
    agent = Agent(config, rt, clock=lambda: clock[0])
    agent.desired = DesiredState(cluster="test-east", generation=1, replicas=[spec("a"), spec("b", bad=True)])

    await agent.reconcile_once()
    a, b = agent.replicas["a"], agent.replicas["b"]
    assert (a.state, b.state) == (ReplicaState.starting, ReplicaState.failed)
    assert b.next_restart_at is None and "invalid spec: bad is not a flag" in b.last_error

    delays = []
    for _ in range(5):  # crash -> wait out the backoff -> restarted
        rt.states["a"] = ReplicaState.failed
        await agent.reconcile_once()
        assert a.state == ReplicaState.failed and a.last_error == "boom"
        delays.append(round(a.next_restart_at - clock[0], 3))
        clock[0] = a.next_restart_at - 0.01
        await agent.reconcile_once()
        assert a.state == ReplicaState.failed  # not yet
        clock[0] += 0.02
        await agent.reconcile_once()
        assert a.state == ReplicaState.starting
    assert delays == [0.2, 0.4, 0.8, 1.6, 2.0]  # restart_backoff_s=0.2 doubling, capped at 2
    assert a.restarts == 5 and rt.started == ["a"] * 6
    clock[0] += 3600
    await agent.reconcile_once()
    assert b.state == ReplicaState.failed and "b" not in rt.started

    # A replica that stayed ready long enough starts its backoff over.
    rt.states["a"] = ReplicaState.ready
    await agent.reconcile_once()
    clock[0] += config.replica.restart_backoff_max_s
    rt.states["a"] = ReplicaState.failed
    await agent.reconcile_once()
    assert round(a.next_restart_at - clock[0], 3) == 0.2

    snap = agent.snapshot()
    assert [(r.replica_id, r.state, r.restarts) for r in snap.replicas] == [
        ("a", ReplicaState.failed, 5),
        ("b", ReplicaState.failed, 0),
    ]
    hb = agent.heartbeat()
    assert hb.desired_generation == 1 and [r.replica_id for r in hb.replicas] == ["a", "b"]


async def test_adopts_live_replicas_from_runtime_json_and_starts_the_rest(config: ClusterConfig) -> None:
    files = LocalState(config.state_dir)
    files.save_desired(DesiredState(cluster="test-east", generation=4, replicas=[spec("a"), spec("b")]))
    handles = {
        rid: ReplicaHandle(replica_id=rid, spec=spec(rid), url=f"http://x:{pid}", pid=pid, restarts=2)
        for rid, pid in (("a", 11), ("b", 12))
    }
    (config.state_dir / "runtime.json").write_text(RuntimeFile(replicas=handles).model_dump_json())
    rt = ScriptedRuntime()
    rt.adoptable = {11}
    rt.states["a"] = ReplicaState.ready
    agent = Agent(config, rt)
    agent.load_from_disk()
    await agent.replica_controller.adopt()
    await agent.reconcile_once()
    assert rt.started == ["b"]  # a adopted, not duplicated
    a = agent.replicas["a"]
    assert (a.state, a.restarts, a.handle.url) == (ReplicaState.ready, 2, "http://x:11")
    saved = RuntimeFile.model_validate_json((config.state_dir / "runtime.json").read_bytes())
    assert saved.replicas["a"].pid == 11 and saved.replicas["b"].pid == 1001


def test_one_agent_per_state_dir(config: ClusterConfig) -> None:
    first = Agent(config, ScriptedRuntime())
    first._acquire_lock()
    try:
        with pytest.raises(AgentLocked, match="another agent"):
            Agent(config, ScriptedRuntime())._acquire_lock()
    finally:
        first._release_lock()
    Agent(config, ScriptedRuntime())._acquire_lock()


def test_cli_refuses_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("cluster: Not_Valid\nsurprise: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cannot use config" in proc.stderr and "cluster" in proc.stderr and "surprise" in proc.stderr
