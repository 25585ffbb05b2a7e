"""The node-health hooks of the local runtimes: every replica runs on this host (the
configured node name, else the host's), and cordon/uncordon/recycle do nothing there (the
agent withholds the node's capacity itself)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.runtime.process import ProcessRuntime
from agent.runtime.sim import SimRuntime
from fleet_base.cluster_config import ClusterConfig
from fleet_base.node_health import local_node_name


@pytest.mark.parametrize("runtime_cls", [ProcessRuntime, SimRuntime])
@pytest.mark.parametrize("configured", ["", "gpu-node-7"])
async def test_local_runtime_node_hooks(
    runtime_cls: type[ProcessRuntime], configured: str, tmp_path: Path
) -> None:
    config = ClusterConfig(cluster="c1", state_dir=tmp_path, node_name=configured)
    rt = runtime_cls(config)
    try:
        node = await rt.replica_node("any-replica")
        assert node == (configured or local_node_name(""))
        await rt.cordon_node(node, "xid 79")
        await rt.uncordon_node(node)
        assert await rt.recycle_node(node) == []
    finally:
        await rt.close()
