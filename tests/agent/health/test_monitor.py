"""The node-health monitor in process: a wrong-answering replica (a probe stand-in at the
HTTP boundary) and an XID through the NVML stand-in file cordon the node, withhold its
capacity, tell the runtime, report faults in heartbeats and metrics; an operator's uncordon
remediates it; a CUDA error from a crashed replica cordons; an out-of-memory does not."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from agent.gateway.node_metrics import NodeHealthCollector
from agent.health.monitor import NodeHealthMonitor
from agent.health.nvml import NvmlSource, write_standin
from agent.health.readings import GpuReading, XidEvent
from agent.health.snapshot import load
from agent.replica import Replica
from agent.runtime.base import ReplicaHandle
from agent.runtime.sim import SimRuntime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import LocalState
from fleet_base.node_health import FaultKind, NodeAction, NodeState
from fleet_base.protocol import DesiredState, PoolInventory, ReplicaSpec, ReplicaState


class Runtime(SimRuntime):
    """The sim runtime with its node hooks recorded."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, str]] = []

    async def cordon_node(self, node: str, reason: str) -> None:
        self.calls.append(("cordon", node))

    async def uncordon_node(self, node: str) -> None:
        self.calls.append(("uncordon", node))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def replica(rid: str, state: ReplicaState = ReplicaState.ready) -> Replica:
    spec = ReplicaSpec(replica_id=rid, deployment="d", version=1, model="m", pool="cpu")
    url = f"http://{rid}.test"
    return Replica(
        spec=spec, state=state, handle=ReplicaHandle(replica_id=rid, spec=spec, url=url), started_at=1.0
    )


def setup(tmp_path: Path, replicas: dict[str, Replica], corrupt: set[str], nvml: Path | None = None):
    config = ClusterConfig(cluster="east", node_name="node-a", state_dir=tmp_path / "state")
    config.health.nvml_interval_s = 0.001
    desired = {"d": DesiredState(cluster="east")}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        text = "Paris!" if host in corrupt else "Paris."
        assert json.loads(request.content)["temperature"] == 0
        return httpx.Response(200, json={"choices": [{"text": text}]})

    clock = Clock()
    runtime = Runtime(config)
    monitor = NodeHealthMonitor(
        config=config,
        runtime=runtime,
        replicas=lambda: replicas,
        desired=lambda: desired["d"],
        files=LocalState(config.state_dir),
        clock=clock,
        http=httpx.AsyncClient(transport=httpx.MockTransport(answer)),
        nvml=NvmlSource(standin=str(nvml) if nvml else str(tmp_path / "none.json")),
        gpus=2,
    )
    config.state_dir.mkdir(parents=True)
    return monitor, runtime, clock, desired


POOLS = [PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=2, nodes=1)]


async def test_wrong_answer_cordons_withholds_and_drains(tmp_path: Path) -> None:
    replicas = {"r1": replica("r1"), "r2": replica("r2")}
    corrupt: set[str] = set()
    monitor, runtime, clock, _ = setup(tmp_path, replicas, corrupt)
    assert await monitor.tick() == []  # start-up answers recorded
    assert monitor.nodes()[0].state == NodeState.healthy and monitor.pools(POOLS) == POOLS
    corrupt.add("r1")
    clock.t += 31  # idle: probed again after probe_idle_s
    moved = await monitor.tick()
    assert [(t.old, t.new) for t in moved] == [(NodeState.healthy, NodeState.cordoned)]
    (node,) = monitor.nodes()
    assert node.node == "node-a" and node.cordoned_by == "agent" and node.gpus_withheld == [0, 1]
    assert node.reason.startswith("wrong_answer: probe answer 'Paris!' differs from 'Paris.'")
    (fault,) = monitor.faults(clock.t)
    assert (fault.kind, fault.replica_id, fault.deployment) == (FaultKind.wrong_answer, "r1", "d")
    assert runtime.calls == [("cordon", "node-a")]
    assert monitor.pools(POOLS)[0].nodes == 0  # the control plane moves the replicas away
    # the fault is repeated for fault_report_s, then no more
    assert monitor.faults(clock.t + 29) and not monitor.faults(clock.t + 31)
    replicas.clear()  # drained through the reconciler once the control plane re-placed them
    clock.t += 1
    assert [t.new for t in await monitor.tick()] == [NodeState.drained]
    text = metrics(monitor)
    assert 'fleet_agent_node_state{node="node-a",state="drained"} 1.0' in text
    assert 'fleet_agent_node_state{node="node-a",state="healthy"} 0.0' in text
    assert 'fleet_agent_gpu_errors_total{gpu="",kind="wrong_answer",node="node-a"} 1.0' in text


def metrics(monitor: NodeHealthMonitor) -> str:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(NodeHealthCollector(lambda: load(monitor.files)))
    return generate_latest(registry).decode()


async def test_xid_through_the_nvml_standin_cordons_and_uncordon_remediates(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    write_standin(path, [GpuReading(index=0), GpuReading(index=1)])
    monitor, runtime, clock, desired = setup(tmp_path, {"r1": replica("r1")}, set(), nvml=path)
    await monitor.tick()
    assert monitor.nodes()[0].state == NodeState.healthy and monitor.nodes()[0].nvml == ""
    write_standin(path, [GpuReading(index=0), GpuReading(index=1, xids=[XidEvent(code=13)])])
    clock.t += 1
    assert await monitor.tick() == []  # an application's XID: counted, not the node's fault
    write_standin(
        path, [GpuReading(index=0), GpuReading(index=1, xids=[XidEvent(code=13), XidEvent(code=79)])]
    )
    clock.t += 1
    await monitor.tick()
    (node,) = monitor.nodes()
    assert node.state == NodeState.cordoned and node.reason == "fell_off_bus on GPU 1: Xid 79"
    assert 'fleet_agent_gpu_errors_total{gpu="1",kind="xid",node="node-a"} 1.0' in metrics(monitor)
    clock.t += 1
    desired["d"] = DesiredState(
        cluster="east",
        node_actions=[NodeAction(node="node-a", action="uncordon", at=clock.t, reason="GPU swapped")],
    )
    moved = await monitor.tick()
    assert [t.new for t in moved] == [NodeState.remediated]
    assert runtime.calls == [("cordon", "node-a"), ("uncordon", "node-a")]
    clock.t += 31  # the next probe is clean: healthy again
    assert [t.new for t in await monitor.tick()] == [NodeState.healthy]


async def test_replica_failures_classified(tmp_path: Path) -> None:
    r = replica("r1", ReplicaState.failed)
    r.failed_at, r.last_error = (
        5.0,
        "exited with code 1; log tail:\ntorch.OutOfMemoryError: CUDA out of memory",
    )
    monitor, _, clock, _ = setup(tmp_path, {"r1": r}, set())
    await monitor.tick()
    assert monitor.nodes()[0].state == NodeState.healthy and monitor.nodes()[0].faults == 1
    r.failed_at, r.last_error = (
        6.0,
        "exited with code 1; log tail:\nRuntimeError: CUDA error: an illegal memory access",
    )
    clock.t += 1
    await monitor.tick()
    (node,) = monitor.nodes()
    assert node.state == NodeState.cordoned  # the failed replica restarts here: not drained
    assert node.reason == "cuda_error: RuntimeError: CUDA error: an illegal memory access"
    assert [f.kind for f in monitor.faults(clock.t)] == [FaultKind.oom, FaultKind.cuda_error]


async def test_without_nvml_the_node_says_why(tmp_path: Path) -> None:
    monitor, *_ = setup(tmp_path, {}, set())
    await monitor.tick()
    assert "unreadable" in monitor.nodes()[0].nvml  # the stand-in file is missing here


async def test_a_foreign_engines_replica_is_not_probed(tmp_path: Path) -> None:
    """llama.cpp's greedy answer may change with what it batches: no probe, so no false cordon."""
    replicas = {"r1": replica("r1"), "r2": replica("r2")}
    for r in replicas.values():
        r.spec = r.spec.model_copy(update={"engine": "llama.cpp"})
    corrupt: set[str] = set()
    monitor, runtime, clock, _ = setup(tmp_path, replicas, corrupt)
    assert await monitor.tick() == []
    corrupt.add("r1")
    clock.t += 31
    assert await monitor.tick() == [] and runtime.calls == []
    assert monitor.nodes()[0].state == NodeState.healthy
