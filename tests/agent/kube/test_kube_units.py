"""Pure parts of the kubernetes runtime: the pod-status table, node placement per
provider, and the capacity signals of the heartbeat."""

from __future__ import annotations

import pytest

from agent.capacity import CapacitySignals, Placed
from agent.runtime.kube_pod import node_placement, replica_pod
from agent.runtime.kube_status import classify
from fleet_base.cluster_config import ClusterConfig
from fleet_base.domain import Tier
from fleet_base.kube_config import KubernetesConfig, PoolPlacement, Toleration
from fleet_base.protocol import PoolInventory, ReplicaState
from tests.agent.kube.conftest import POOLS, spec, validate


def pod(phase="Pending", tier="spot", conditions=(), container=None, deleting=False, **status) -> dict:
    meta = {"name": "p", "labels": {"fleet.dev/tier": tier}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    st = {"phase": phase, "conditions": [dict(c) for c in conditions], **status}
    if container is not None:
        st["containerStatuses"] = [{"name": "engine", "state": container}]
    return {"metadata": meta, "status": st}


def disruption(reason: str) -> dict:
    """The condition Kubernetes sets on a pod it is about to evict, for `reason`."""
    return {"type": "DisruptionTarget", "status": "True", "reason": reason}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes"}
S, R, D, F = ReplicaState.starting, ReplicaState.ready, ReplicaState.draining, ReplicaState.failed


@pytest.mark.parametrize(
    ("obj", "state", "preempted", "unschedulable", "word"),
    [
        (pod(), S, False, False, ""),
        (pod(conditions=[UNSCHEDULABLE]), S, False, True, "0/2 nodes"),
        (pod(container={"waiting": {"reason": "ErrImagePull", "message": "no such tag"}}), F, False, False, "ErrImagePull"),
        (pod(container={"waiting": {"reason": "CreateContainerConfigError", "message": "secret x"}}), F, False, False, "secret x"),
        (pod(container={"waiting": {"reason": "ContainerCreating"}}), S, False, False, ""),
        (pod("Running", conditions=[{"type": "Ready", "status": "False"}]), S, False, False, ""),
        (pod("Running", conditions=[{"type": "Ready", "status": "True"}]), R, False, False, ""),
        (pod("Running", deleting=True), D, False, False, ""),
        (pod("Failed", container={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), F, False, False, "OOMKilled"),
        (pod("Failed", reason="Evicted", message="low on ephemeral-storage"), F, False, False, "Evicted"),
        (pod("Failed", conditions=[disruption("DeletionByTaintManager")]), F, True, False, "node lost"),
        (pod("Failed", tier="on-demand", reason="NodeShutdown"), F, False, False, "node lost"),
        (pod("Failed", conditions=[disruption("PreemptionByScheduler")]), F, False, False, ""),
    ],
)  # fmt: skip
def test_pod_status_table(obj, state, preempted, unschedulable, word) -> None:
    view = classify(obj, "32Gi")
    assert (view.state, view.preempted, view.unschedulable) == (state, preempted, unschedulable)
    assert word in view.error


def test_oom_names_the_limit() -> None:
    view = classify(pod("Failed", container={"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), "32Gi")
    assert "32Gi memory limit" in view.error and view.exit_code == 137


H100_SPOT = POOLS[0]
L4 = PoolInventory(name="l4", gpu_model="L4", gpu_memory_gb=24, tier=Tier.on_demand)
A100_80 = PoolInventory(name="a100", gpu_model="NVIDIA A100", gpu_memory_gb=80, tier=Tier.reserved)


GPU = "nvidia.com/gpu"
MINE = PoolPlacement(
    node_selector={"pool": "mine"}, tolerations=[Toleration(key="dedicated", operator="Equal", value="llm")]
)


@pytest.mark.parametrize(
    ("pool", "placement", "provider", "selector", "tolerations"),
    [
        (L4, None, "gke", {"cloud.google.com/gke-accelerator": "nvidia-l4"}, {GPU}),
        (A100_80, None, "gke", {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}, {GPU}),
        (H100_SPOT, PoolPlacement(node_pool="a3-spot"), "gke",
         {"cloud.google.com/gke-nodepool": "a3-spot", "cloud.google.com/gke-spot": "true"}, {GPU, "cloud.google.com/gke-spot"}),
        (H100_SPOT, PoolPlacement(node_pool="p5-spot"), "eks",
         {"eks.amazonaws.com/nodegroup": "p5-spot", "eks.amazonaws.com/capacityType": "SPOT"}, {GPU}),
        (L4, None, "eks", {"eks.amazonaws.com/capacityType": "ON_DEMAND"}, {GPU}),
        (H100_SPOT, PoolPlacement(node_pool="gpuspot"), "aks",
         {"kubernetes.azure.com/agentpool": "gpuspot", "kubernetes.azure.com/scalesetpriority": "spot"},
         {GPU, "kubernetes.azure.com/scalesetpriority"}),
        (L4, MINE, "generic", {"pool": "mine"}, {GPU, "dedicated"}),
        (PoolInventory(name="cpu", gpu_model="cpu"), None, "gke", {}, set()),
    ],
)  # fmt: skip
def test_node_placement_per_provider(pool, placement, provider, selector, tolerations) -> None:
    sel, tol = node_placement(pool, placement, provider)
    assert sel == selector
    assert {t["key"] for t in tol} == tolerations
    config = ClusterConfig(
        cluster="c",
        pools=[pool],
        kubernetes=KubernetesConfig(
            node_provider=provider, pools={pool.name: placement} if placement else {}
        ),
    )
    validate(replica_pod(spec(pool=pool.name), config, pool))


def test_replica_secret_mounts_read_only() -> None:
    config = ClusterConfig(
        cluster="c", kubernetes=KubernetesConfig(replica_secret="fleet-replica-credentials")
    )
    obj = replica_pod(spec(pool="cpu"), config, PoolInventory(name="cpu", gpu_model="cpu"))
    validate(obj)
    (vol,) = [v for v in obj["spec"]["volumes"] if v["name"] == "credentials"]
    assert vol["secret"] == {"secretName": "fleet-replica-credentials", "defaultMode": 0o440}
    (mount,) = [m for m in obj["spec"]["containers"][0]["volumeMounts"] if m["name"] == "credentials"]
    assert mount == {"name": "credentials", "mountPath": "/etc/fleet/credentials", "readOnly": True}


def test_model_volumes_and_cpu_pool_validate() -> None:
    for volume in ({"kind": "pvc", "claim_name": "models"}, {"kind": "host_path"}, {"kind": "none"}):
        config = ClusterConfig(
            cluster="c", kubernetes=KubernetesConfig.model_validate({"model_volume": volume})
        )
        obj = replica_pod(spec(pool="cpu"), config, PoolInventory(name="cpu", gpu_model="cpu"))
        validate(obj)
        assert "nvidia.com/gpu" not in obj["spec"]["containers"][0]["resources"]["requests"]
        assert ("models" in {v["name"] for v in obj["spec"]["volumes"]}) == (volume["kind"] != "none")


def test_unschedulable_shrinks_pool_for_the_hold_then_restores() -> None:
    caps = CapacitySignals(hold_s=600)
    declared = [POOLS[0]]  # 2 nodes x 8 GPUs
    caps.observe([Placed("a", "h100-spot", 8, False), Placed("b", "h100-spot", 8, True)], now=0)
    assert caps.unschedulable == ["b"]
    assert caps.pools(declared, now=10)[0].nodes == 1
    caps.observe([Placed("a", "h100-spot", 8, False)], now=20)  # b re-placed elsewhere
    assert caps.unschedulable == [] and caps.pools(declared, now=300)[0].nodes == 1
    assert caps.pools(declared, now=601)[0].nodes == 2
    caps.observe([Placed("c", "h100-spot", 4, True)], now=700)  # nothing scheduled at all
    assert caps.pools(declared, now=701)[0].nodes == 0


def test_preempted_ids_repeat_for_the_report_window() -> None:
    caps = CapacitySignals(report_s=30)
    caps.preempt("x", now=100)
    assert caps.preempted(now=110) == ["x"]
    assert caps.preempted(now=131) == []


def test_agent_cli_selects_kubernetes_and_refuses_what_cannot_work(tmp_path, capsys, monkeypatch) -> None:
    from agent.__main__ import main
    from fleet_base import heap_trim

    monkeypatch.setattr(heap_trim, "start", lambda *_a, **_k: None)  # this process's allocator stays as it is
    path = tmp_path / "cluster.yaml"
    ClusterConfig(cluster="c", state_dir=tmp_path / "state").dump(path)  # runtime: process
    assert main(["--config", str(path), "--runtime", "kubernetes"]) == 2
    assert "declare the cluster's pools" in capsys.readouterr().err
    ClusterConfig(cluster="c", state_dir=tmp_path / "state", pools=POOLS).dump(path)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")  # not in a pod
    assert main(["--config", str(path), "--runtime", "kubernetes"]) == 2
    assert "no usable Kubernetes API credentials" in capsys.readouterr().err


def test_unschedulable_gauge_is_zero_where_all_schedule() -> None:
    from agent.gateway.capacity_metrics import UnschedulableCollector
    from fleet_base.protocol import ReplicaStatus

    def status(rid: str, pool: str, stuck: bool) -> ReplicaStatus:
        return ReplicaStatus(
            replica_id=rid,
            deployment="chat",
            version=1,
            state=ReplicaState.starting,
            pool=pool,
            unschedulable=stuck,
        )

    replicas = [status("a", "cpu", False), status("b", "l4", True), status("c", "l4", False)]
    (family,) = UnschedulableCollector(lambda: replicas).collect()
    assert [(s.labels["pool"], s.value) for s in family.samples] == [("cpu", 0), ("l4", 1)]
