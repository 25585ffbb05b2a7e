"""`fleetctl pipeline` as a user runs it, against a real control plane on SQLite: create
(steps in order, --slo-e2e parsed as a duration), ls and get (tables and JSON, per-cluster
readiness from stored replica states), rm, and one-line errors."""

from __future__ import annotations

from control_plane.db.models import Cluster, Deployment, ReplicaAssignment
from control_plane.db.session import make_sessions
from tests.control_plane.cp_server import ControlPlaneServer
from tests.fleetctl import fleetctl, fleetctl_json

WIDE = {"COLUMNS": "200"}


def test_fleetctl_pipeline(sqlite_server: ControlPlaneServer) -> None:
    home = sqlite_server.home
    sessions = make_sessions(sqlite_server.database_url)
    with sessions() as s:
        s.add_all([Cluster(id="pl-west", region="eu-west"), Deployment(name="bge"), Deployment(name="qwen")])
        s.flush()
        ids = {d.name: d.id for d in s.query(Deployment).filter(Deployment.name.in_(["bge", "qwen"]))}
        s.add_all(
            [
                ReplicaAssignment(
                    replica_id="bge-1",
                    deployment_id=ids["bge"],
                    version=1,
                    cluster_id="pl-west",
                    state="ready",
                ),
                ReplicaAssignment(
                    replica_id="qwen-1",
                    deployment_id=ids["qwen"],
                    version=1,
                    cluster_id="pl-west",
                    state="ready",
                ),
            ]
        )
        s.commit()
    sessions.kw["bind"].dispose()

    created = fleetctl_json(
        home,
        "pipeline",
        "create",
        "rag",
        "--step",
        "embed=bge",
        "--step",
        "answer=qwen",
        "--slo-e2e",
        "800ms",
    )
    assert created["steps"] == [
        {"name": "embed", "deployment": "bge"},
        {"name": "answer", "deployment": "qwen"},
    ]
    assert created["slo_e2e_s"] == 0.8 and created["ready_clusters"] == ["pl-west"]

    listed = fleetctl_json(home, "pipeline", "ls")
    assert [p["name"] for p in listed] == ["rag"]
    table = fleetctl(home, "pipeline", "ls", env=WIDE).stdout
    assert "embed=bge -> answer=qwen" in table and "800ms" in table and "pl-west" in table

    got = fleetctl_json(home, "pipeline", "get", "rag")
    west = next(c for c in got["clusters"] if c["cluster"] == "pl-west")
    assert west == {
        "cluster": "pl-west",
        "region": "eu-west",
        "ready": True,
        "steps": {"embed": 1, "answer": 1},
    }
    shown = fleetctl(home, "pipeline", "get", "rag", env=WIDE).stdout
    assert "readiness of rag per cluster" in shown and "pl-west" in shown and "yes" in shown

    missing = fleetctl(home, "pipeline", "create", "bad", "--step", "embed=nope", check=False)
    assert missing.returncode == 1 and "not found: embed -> nope" in missing.stderr
    malformed = fleetctl(home, "pipeline", "create", "bad", "--step", "embed", check=False)
    assert malformed.returncode == 1 and "STEP=DEPLOYMENT" in malformed.stderr

    for verb in ("get", "rm"):
        for bad in ("../keys", "RAG", "a/b"):
            refused = fleetctl(home, "pipeline", verb, bad, check=False)
            assert refused.returncode == 1 and f"pipeline name {bad!r}" in refused.stderr
            assert "Traceback" not in refused.stderr
    assert [p["name"] for p in fleetctl_json(home, "pipeline", "ls")] == ["rag"]

    assert "deleted pipeline rag" in fleetctl(home, "pipeline", "rm", "rag").stdout
    gone = fleetctl(home, "pipeline", "get", "rag", check=False)
    assert gone.returncode == 1 and "not found" in gone.stderr
