"""Node health on the control plane, in process against SQLite: heartbeats' nodes and
faults stored (each fault once, a forged or implausible one refused), `/v1/nodes` reads
(404 for an unknown node), and an operator's cordon published in the cluster's
DesiredState and taken out of the placer's capacity until the agent withholds it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from control_plane.api.app import build_app
from control_plane.api.routers.keys import make_key
from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.fleet_model.plan import build_desired, placement_inputs
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.loops.ingest import apply_heartbeat
from control_plane.settings import Settings
from fleet_base.domain import Coordinates, Tier
from fleet_base.node_health import FaultKind, NodeFault, NodeHealth, NodeState, is_node_fault
from fleet_base.protocol import Heartbeat, PoolInventory


def heartbeat(cluster: str = "c1", nodes=("n1",), faults=(), states=None, **kw) -> Heartbeat:
    states = states or {}
    return Heartbeat(
        cluster=cluster,
        provider="local",
        region="eu-west",
        coordinates=Coordinates(lat=50, lon=8),
        pools=[PoolInventory(name="cpu", gpu_model="cpu", gpus_per_node=2, nodes=2, tier=Tier.on_demand)],
        nodes=[
            NodeHealth(node=n, gpus=2, state=states.get(n, NodeState.healthy), nvml="no NVML on this host")
            for n in nodes
        ],
        node_faults=list(faults),
        **kw,
    )


def beat(sessions, hb: Heartbeat) -> bool:
    with sessions() as s:
        changed = apply_heartbeat(s, hb, m.utcnow())
        s.commit()
        return changed


def stored(sessions, model, **where) -> list:
    with sessions() as s:
        q = select(model)
        for k, v in where.items():
            q = q.where(getattr(model, k) == v)
        return list(s.scalars(q))


class Api:
    def __init__(self, app, sessions) -> None:
        self.app, self.sessions = app, sessions

    def client(self, scopes: list[str] | None = None) -> TestClient:
        row, secret = make_key("tester", scopes or ["admin"], None, {})
        with self.sessions() as s:
            s.add(row)
            s.commit()
        return TestClient(self.app, headers={"Authorization": f"Bearer {secret}"})


@pytest.fixture
def api(sessions, tmp_path) -> Iterator[Api]:
    ctx = ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions)
    yield Api(build_app(ctx, run_loops=False), sessions)


def test_faults_are_stored_once_counted_per_node_and_oom_is_not_a_failure(api: Api, sessions) -> None:
    now = time.time()
    xid = NodeFault(node="n1", gpu=3, kind=FaultKind.xid, at=now - 5, evidence="XID 79")
    oom = NodeFault(node="n1", kind=FaultKind.oom, at=now - 4, replica_id="r-1", deployment="chat")
    hb = heartbeat(nodes=("n1", "n2"), faults=[xid, oom], states={"n1": NodeState.cordoned})
    assert beat(sessions, hb)  # n1's state changed: placement may change
    assert not beat(sessions, hb)  # the same faults again (repeated for ~30 s): nothing new
    assert len(stored(sessions, m.NodeFaultRecord)) == 2
    assert [e.message for e in stored(sessions, m.Event, kind="node_fault")] == [
        "n1: xid on GPU 3: XID 79",
        "n1: oom on the node",
    ]
    assert [e.message for e in stored(sessions, m.Event, kind="node_state")] == ["n1: new -> cordoned"]
    (fault,) = stored(sessions, m.NodeFaultRecord, kind="xid")
    assert (fault.cluster, fault.gpu, fault.pool, fault.provider) == ("c1", 3, "cpu", "local")

    with api.client(["read"]) as client:
        listed = client.get("/v1/nodes").json()
        assert listed["total"] == 2
        rows = {n["node"]: n for n in listed["items"]}
        assert (rows["n1"]["state"], rows["n1"]["failures"]) == ("cordoned", 1)  # the oom is not counted
        n2 = rows["n2"]
        assert (n2["state"], n2["failures"], n2["last_fault_at"]) == ("healthy", 0, None)
        assert rows["n1"]["nvml"] == "no NVML on this host" and rows["n1"]["gpus"] == 2
        cordoned = client.get("/v1/nodes", params={"state": "cordoned"}).json()["items"]
        assert [n["node"] for n in cordoned] == ["n1"]
        assert client.get("/v1/nodes", params={"cluster": "other"}).json()["total"] == 0
        assert client.get("/v1/nodes", params={"state": "sick"}).status_code == 422
        detail = client.get("/v1/nodes/c1/n1").json()
        assert [(f["kind"], f["node_fault"]) for f in detail["faults"]] == [("oom", False), ("xid", True)]


def test_forged_and_implausible_faults_are_refused_and_the_rest_kept(sessions, caplog) -> None:
    now = time.time()
    good = NodeFault(node="n1", kind=FaultKind.wrong_answer, at=now)
    forged = NodeFault(node="not-mine", kind=FaultKind.xid, at=now)
    future = NodeFault(node="n1", kind=FaultKind.xid, at=now + 3600)
    stale = NodeFault(node="n1", kind=FaultKind.xid, at=now - 2 * 86_400)
    beat(sessions, heartbeat(faults=[forged, future, good, stale]))
    assert [f.fault_id for f in stored(sessions, m.NodeFaultRecord)] == [good.fault_id]
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 3 and "'not-mine' is not one this heartbeat reports" in refused[0]


def test_a_cluster_writes_only_its_own_nodes(sessions) -> None:
    beat(sessions, heartbeat("c1", states={"n1": NodeState.cordoned}))
    # c2 reports a node of the same name, healthy: its own row, c1's untouched
    beat(sessions, heartbeat("c2", faults=[NodeFault(node="n1", kind=FaultKind.stall)]))
    rows = {(n.cluster, n.node): n.state for n in stored(sessions, m.Node)}
    assert rows == {("c1", "n1"): "cordoned", ("c2", "n1"): "healthy"}
    assert [f.cluster for f in stored(sessions, m.NodeFaultRecord)] == ["c2"]


def test_unknown_node_is_a_404_with_a_reason(api: Api, sessions) -> None:
    beat(sessions, heartbeat())
    with api.client() as client:
        for r in (
            client.get("/v1/nodes/c1/nope"),
            client.post("/v1/nodes/c1/nope/cordon", json={"reason": "x"}),
            client.post("/v1/nodes/c9/n1/uncordon"),
        ):
            assert r.status_code == 404, r.text
            assert "not found" in r.json()["error"]["message"]
        assert client.get("/v1/nodes/c1/bad%20name").status_code == 422


def test_cordon_is_admin_only_audited_and_carried_in_the_desired_state(api: Api, sessions) -> None:
    beat(sessions, heartbeat(nodes=("n1", "n2")))
    with api.client(["read"]) as reader:
        assert reader.post("/v1/nodes/c1/n1/cordon").status_code == 403
    with api.client() as admin:
        r = admin.post("/v1/nodes/c1/n1/cordon", json={"reason": "bad fan"})
        assert r.status_code == 200, r.text
        assert r.json()["operator"]["action"] == "cordon" and r.json()["operator"]["reason"] == "bad fan"
        assert admin.post("/v1/nodes/c1/n2/uncordon").status_code == 200  # no body: reason ""
        audit = admin.get("/v1/audit", params={"resource_type": "node"}).json()["items"]
        assert sorted(a["action"] for a in audit) == ["node.cordon", "node.uncordon"]

    with sessions() as s:
        snap = read_snapshot(s)
    desired = build_desired(snap, [])["c1"]
    assert [(a.node, a.action, a.reason) for a in desired.node_actions] == [
        ("n1", "cordon", "bad fan"),
        ("n2", "uncordon", ""),
    ]
    # the agent has not withheld n1 yet: the placer sees the pool one node smaller
    _, pools, _ = placement_inputs(snap)
    assert [(p.name, p.nodes) for p in pools] == [("cpu", 1)]

    # the agent applied it: its pools already exclude n1 (here: reported as 1 node), no second subtraction
    shrunk = heartbeat(nodes=("n1", "n2"), states={"n1": NodeState.cordoned})
    shrunk.pools[0].nodes = 1
    beat(sessions, shrunk)
    with sessions() as s:
        _, pools, _ = placement_inputs(read_snapshot(s))
    assert [(p.name, p.nodes) for p in pools] == [("cpu", 1)]

    with api.client() as admin:
        admin.post("/v1/nodes/c1/n1/uncordon")
    with sessions() as s:
        desired = build_desired(read_snapshot(s), [])["c1"]
        assert [(a.node, a.action) for a in desired.node_actions] == [("n2", "uncordon"), ("n1", "uncordon")]
        assert s.scalar(select(func.count()).select_from(m.Event).where(m.Event.kind == "node_action")) == 3


def test_metrics_count_nodes_by_state_faults_by_kind_and_price_the_flaky_pool(api: Api, sessions) -> None:
    now = time.time()
    faults = [
        NodeFault(node="n1", kind=FaultKind.xid, at=now),
        NodeFault(node="n1", kind=FaultKind.oom, at=now),
    ]
    beat(sessions, heartbeat(nodes=("n1", "n2"), faults=faults, states={"n1": NodeState.suspect}))
    with api.client() as client:
        text = client.get("/metrics").text
    assert 'fleet_nodes{cluster="c1",state="suspect"} 1.0' in text
    assert 'fleet_nodes{cluster="c1",state="healthy"} 1.0' in text
    assert 'fleet_nodes{cluster="c1",state="retired"} 0.0' in text
    assert 'fleet_node_faults_total{cluster="c1",kind="xid",node_fault="true"} 1.0' in text
    assert 'fleet_node_faults_total{cluster="c1",kind="xid",node_fault="false"} 0.0' in text
    assert 'fleet_node_faults_total{cluster="c1",kind="oom",node_fault="false"} 1.0' in text
    line = next(
        x for x in text.splitlines() if x.startswith('fleet_pool_reliability_premium_dollars{cluster="c1"')
    )
    assert float(line.split()[-1]) > 0  # one node fault this week on a 2-node pool


@pytest.mark.parametrize(
    "kind, evidence, counts",
    [
        (FaultKind.xid, "Xid 79", True),  # fallen off the bus: hardware
        (FaultKind.xid, "Xid 13", False),  # graphics engine exception: the application's
        (FaultKind.xid, "xid 43 on GPU 1", False),
        (FaultKind.xid, "", True),  # no code: an XID of no known class counts
        (FaultKind.oom, "CUDA out of memory", False),
        (FaultKind.cuda_error, "Xid 13 in the log", True),  # only the xid kind is read for a code
        (FaultKind.wrong_answer, "", True),
    ],
)
def test_what_counts_against_a_node(kind, evidence, counts) -> None:
    assert is_node_fault(kind, evidence) is counts


def test_an_application_xid_is_recorded_but_not_a_failure(api: Api, sessions) -> None:
    now = time.time()
    app = NodeFault(node="n1", gpu=0, kind=FaultKind.xid, at=now, evidence="Xid 31")
    beat(sessions, heartbeat(faults=[app]))
    with api.client(["read"]) as client:
        node = client.get("/v1/nodes/c1/n1").json()
    assert node["failures"] == 0 and [f["node_fault"] for f in node["faults"]] == [False]
