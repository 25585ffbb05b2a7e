"""One cluster id rule: the admin API registers exactly the clusters whose agent can load its
`cluster.yaml` and whose heartbeats the wire decoder accepts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from control_plane.api.schemas import ClusterCreate
from fleet_base import protocol
from fleet_base.cluster_config import ClusterConfig
from fleet_base.wire import Rejected, decode_heartbeat

IDS = ["east", "a", "edge-1", "9z", "x" * 63, "x" * 64, "Edge1", "edge_1", "a.b", "-east", "", "east\n"]


def api_accepts(cluster: str) -> bool:
    try:
        ClusterCreate(id=cluster)
    except ValidationError:
        return False
    return True


def agent_accepts(cluster: str) -> bool:
    try:
        ClusterConfig(cluster=cluster)
    except ValidationError:
        return False
    return True


def wire_accepts(cluster: str) -> bool:
    try:
        decode_heartbeat(protocol.heartbeat_subject(cluster), protocol.Heartbeat(cluster=cluster).to_bytes())
    except Rejected:
        return False
    return True


@pytest.mark.parametrize("cluster", IDS)
def test_api_agent_and_wire_agree_on_cluster_ids(cluster: str) -> None:
    assert api_accepts(cluster) == agent_accepts(cluster) == wire_accepts(cluster)


def test_the_rule_is_lowercase_digits_and_dashes() -> None:
    assert [c for c in IDS if api_accepts(c)] == ["east", "a", "edge-1", "9z", "x" * 63]
