"""Fixtures for the kubernetes runtime: the fake API server (see fake_apiserver.py: it
stands in for a real one), a cluster config pointing at it, strict schema validation."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest

from agent.runtime.base import ReplicaHandle
from agent.runtime.kubernetes import KubernetesRuntime
from fleet_base.cluster_config import ClusterConfig, ReplicaConfig
from fleet_base.domain import Tier
from fleet_base.kube_config import KubernetesConfig
from fleet_base.protocol import PoolInventory, ReplicaSpec, Resources
from tests.agent.kube.fake_apiserver import FakeApiServer

K8S_VERSION = "1.30.0"
# kubernetes-validate re-reads its (large) schema files on every call; they never change
# within a run, so read each once. Validation itself is untouched.
if not hasattr(kubernetes_validate.utils.schema_contents, "cache_info"):
    kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
        kubernetes_validate.utils.schema_contents
    )
NAMESPACE = "fleet"

AGENT_DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "fleet-agent", "labels": {"app.kubernetes.io/name": "fleet-agent"}},
    "spec": {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "fleet-agent"}},
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/name": "fleet-agent"}},
            "spec": {"containers": [{"name": "agent", "image": "fleet-platform:0.1.0"}]},
        },
    },
}

POOLS = [
    PoolInventory(
        name="h100-spot", gpu_model="H100", gpu_memory_gb=80, gpus_per_node=8, nodes=2, tier=Tier.spot
    ),
    PoolInventory(
        name="h100", gpu_model="H100", gpu_memory_gb=80, gpus_per_node=8, nodes=1, tier=Tier.on_demand
    ),
]


def validate(obj: dict) -> None:
    """Strict validation against the official 1.30 OpenAPI schemas (unknown fields fail)."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def spec(
    replica_id: str = "chat-v1-abc123", pool: str = "h100-spot", gpus: int = 1, version: int = 1
) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=replica_id,
        deployment="chat",
        version=version,
        model="/models/smollm2-135m",
        engine_args={"max_num_seqs": 8},
        resources=Resources(gpu_models=["H100"], gpu_count=gpus),
        pool=pool,
    )


def config_for(api: FakeApiServer, tmp_path: Path, **kube: object) -> ClusterConfig:
    return ClusterConfig(
        cluster="gke-east",
        provider="gcp",
        runtime="kubernetes",
        state_dir=tmp_path / "state",
        pools=POOLS,
        replica=ReplicaConfig(drain_timeout_s=2.0, startup_timeout_s=900, restart_backoff_s=1.0),
        kubernetes=KubernetesConfig(
            server=api.url, namespace=NAMESPACE, node_provider="gke", unschedulable_after_s=0, **kube
        ),
    )


@contextlib.asynccontextmanager
async def fake_cluster() -> AsyncIterator[FakeApiServer]:
    """The fake API server with the agent's own Deployment in the Fleet namespace."""
    async with FakeApiServer() as server:
        server.add(AGENT_DEPLOYMENT, namespace=NAMESPACE)
        yield server


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with fake_cluster() as server:
        yield server


def run_ready(api: FakeApiServer, name: str) -> None:
    """Schedule the pod `name` and run it, ready."""
    api.schedule(name, namespace=NAMESPACE)
    api.run(name, ready=True, namespace=NAMESPACE)


async def start_running(
    api: FakeApiServer, rt: KubernetesRuntime, replica: ReplicaSpec
) -> tuple[ReplicaHandle, str]:
    """Start `replica` through the runtime and run its pod, ready: its handle and pod name."""
    handle = await rt.start(replica)
    name = handle.pod.split("/")[1]
    run_ready(api, name)
    return handle, name
