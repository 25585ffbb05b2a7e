"""`fleetctl nodes` as a user runs it, against a real control plane on SQLite whose
database holds what a heartbeat reported: ls (table and JSON list), show (the faults
table), cordon and uncordon, and an unknown node's one-line error."""

from __future__ import annotations

import time

from control_plane.db.models import utcnow
from control_plane.db.session import make_sessions
from control_plane.loops.ingest import apply_heartbeat
from fleet_base.node_health import FaultKind, NodeFault, NodeState
from tests.control_plane.cp_server import ControlPlaneServer
from tests.control_plane.test_nodes_api import heartbeat
from tests.fleetctl import fleetctl, fleetctl_json


def test_fleetctl_nodes(sqlite_server: ControlPlaneServer) -> None:
    now = time.time()
    faults = [
        NodeFault(node="gpu-1", gpu=2, kind=FaultKind.ecc_uncorrectable, at=now - 60, evidence="DBE 3"),
        NodeFault(
            node="gpu-1", kind=FaultKind.wrong_answer, at=now - 30, replica_id="chat-1", deployment="chat"
        ),
    ]
    hb = heartbeat("edge", nodes=("gpu-1", "gpu-2"), faults=faults, states={"gpu-1": NodeState.cordoned})
    hb.nodes[0].reason = "ecc_uncorrectable on GPU 2"
    sessions = make_sessions(sqlite_server.database_url)
    with sessions() as s:
        apply_heartbeat(s, hb, utcnow())
        s.commit()
    sessions.kw["bind"].dispose()
    home = sqlite_server.home

    listed = fleetctl_json(home, "nodes", "ls")
    assert isinstance(listed, list)
    rows = {(n["cluster"], n["node"]): n for n in listed}
    one = rows[("edge", "gpu-1")]
    assert (one["state"], one["reason"], one["failures"]) == ("cordoned", "ecc_uncorrectable on GPU 2", 2)
    assert rows[("edge", "gpu-2")]["failures"] == 0

    table = fleetctl(
        home, "nodes", "ls", "--cluster", "edge", "--state", "cordoned", env={"COLUMNS": "200"}
    ).stdout
    assert "gpu-1" in table and "cordoned" in table and "gpu-2" not in table

    shown = fleetctl(home, "nodes", "show", "edge", "gpu-1", env={"COLUMNS": "200"}).stdout
    for cell in ("ecc_uncorrectable", "DBE 3", "wrong_answer", "chat-1", "failures"):
        assert cell in shown, cell

    out = fleetctl(home, "nodes", "cordon", "edge", "gpu-2", "--reason", "fan noise").stdout
    assert "cordon of edge/gpu-2 sent to its agent" in out
    back = fleetctl_json(home, "nodes", "uncordon", "edge", "gpu-2")
    assert back["operator"]["action"] == "uncordon" and back["node"] == "gpu-2"

    missing = fleetctl(home, "nodes", "show", "edge", "nope", check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr
