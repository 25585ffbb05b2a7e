"""`prometheus-targets.json` of a local fleet: what Prometheus's file_sd reads."""

from __future__ import annotations

import json
import os
import stat

from control_plane.local.fleet import FleetState, LocalFleet, ProcessRecord
from control_plane.local.prometheus_sd import host_port
from fleet_base.local_state import LocalState, ReplicaSnapshot
from fleet_base.protocol import ReplicaState, ReplicaStatus


def _state(fleet: LocalFleet) -> FleetState:
    state = fleet.new_state(["local-east", "local-west"])
    state.api_url = "http://127.0.0.1:7070"
    state.processes = [
        ProcessRecord(kind="control-plane", name="control-plane", pid=os.getpid(), url=state.api_url),
        ProcessRecord(kind="agent", name="local-east", pid=os.getpid()),
        ProcessRecord(kind="gateway", name="local-east", pid=os.getpid(), url="http://127.0.0.1:9001"),
        ProcessRecord(kind="gateway", name="local-west", pid=os.getpid(), url="http://127.0.0.1:9002"),
    ]
    return state


def _replica(rid: str, port: int | None, state: ReplicaState = ReplicaState.ready) -> ReplicaStatus:
    url = f"http://127.0.0.1:{port}" if port else ""
    return ReplicaStatus(replica_id=rid, deployment="chat", version=2, state=state, url=url)


def test_targets_list_control_plane_gateways_and_replicas(tmp_path):
    fleet = LocalFleet(tmp_path)
    state = _state(fleet)
    fleet.save(state)
    east = LocalState(fleet.dir / "clusters" / "local-east" / "state")
    east.save_replicas(
        ReplicaSnapshot(
            cluster="local-east",
            replicas=[_replica("r-1", 8101), _replica("r-2", None, ReplicaState.pending)],
        )
    )
    # local-west has no replicas.json yet (agent not up): gateway only

    path = fleet.write_prometheus_targets(state)
    assert path == tmp_path / "local" / "prometheus-targets.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    groups = json.loads(path.read_text())
    by_target = {g["targets"][0]: g["labels"] for g in groups}
    assert all(len(g["targets"]) == 1 for g in groups)
    assert set(by_target) == {"127.0.0.1:7070", "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:8101"}
    assert by_target["127.0.0.1:7070"] == {"fleet": state.fleet_id, "kind": "control-plane"}
    assert by_target["127.0.0.1:9002"] == {
        "fleet": state.fleet_id,
        "kind": "gateway",
        "cluster": "local-west",
        "region": "local-west",
    }
    assert by_target["127.0.0.1:8101"] == {
        "fleet": state.fleet_id,
        "kind": "replica",
        "cluster": "local-east",
        "region": "local-east",
        "deployment": "chat",
        "replica": "r-1",
        "version": "2",
    }


def test_ps_refreshes_the_targets(tmp_path):
    fleet = LocalFleet(tmp_path)
    state = _state(fleet)
    fleet.save(state)
    fleet.ps()
    first = json.loads(fleet.targets_path.read_text())
    assert not [g for g in first if g["labels"]["kind"] == "replica"]

    west = LocalState(fleet.dir / "clusters" / "local-west" / "state")
    west.save_replicas(ReplicaSnapshot(cluster="local-west", replicas=[_replica("w-1", 8201)]))
    fleet.ps()
    replicas = [g for g in json.loads(fleet.targets_path.read_text()) if g["labels"]["kind"] == "replica"]
    assert [(g["targets"], g["labels"]["replica"]) for g in replicas] == [(["127.0.0.1:8201"], "w-1")]


def test_host_port():
    assert host_port("http://127.0.0.1:9001/v1") == "127.0.0.1:9001"
    assert host_port("http://[::1]:9001") == "[::1]:9001"
    assert host_port("") is None
    assert host_port("http://example.com") is None  # no port: not guessable for a local fleet
