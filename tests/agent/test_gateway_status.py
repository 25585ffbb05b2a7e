"""The gateway's queue depth reaches the agent's heartbeat through gateway.json:
the autoscaler sees requests queued at the gateway, not only those waiting in replicas."""

from __future__ import annotations

import time
from pathlib import Path

from agent.daemon import Agent
from fleet_base.cluster_config import ClusterConfig
from fleet_base.local_state import GatewayStatus, LocalState


def test_gateway_queue_depth_is_in_the_heartbeat_while_fresh(tmp_path: Path) -> None:
    config = ClusterConfig(cluster="east", state_dir=tmp_path / "state")
    local = LocalState(config.state_dir)
    agent = Agent(config)
    assert agent.heartbeat().queue_depth == 0  # no gateway yet
    local.save_gateway(GatewayStatus(queue_depth=7, by_class={"batch": 5, "interactive": 2}))
    assert agent.heartbeat().queue_depth == 7
    local.save_gateway(GatewayStatus(queue_depth=3, updated_at=time.time() - 60))
    assert agent.heartbeat().queue_depth == 0  # a stopped gateway queues nothing
    local.gateway_path.write_text("{not json")
    assert agent.heartbeat().queue_depth == 0
