"""What the control plane publishes for data residency: each route carries its cluster's
jurisdiction (by_region lists too), a table carries its deployment's policy and leaves out
clusters outside it, desired state carries the cluster's own jurisdiction, and key records
carry the key's policy."""

from __future__ import annotations

from control_plane.db import models as m
from control_plane.fleet_model.plan import build_desired, build_routes
from control_plane.fleet_model.snapshot import live_keys, read_snapshot
from control_plane.loops.usage import store_records
from fleet_base.protocol import UsageRecord


def _fleet(sessions, residency=None):
    with sessions() as s:
        for cid, region, jurisdiction in (
            ("east", "ca-east", "ca"),
            ("west", "us-west", "us"),
            ("x", "r", ""),
        ):
            s.add(
                m.Cluster(
                    id=cid, region=region, jurisdiction=jurisdiction, gateway_url=f"http://{cid}:9000",
                    last_heartbeat_at=m.utcnow(), load={},
                )
            )  # fmt: skip
        d = m.Deployment(name="chat", replicas=3, current_version=1, residency=residency)
        d.versions = [m.DeploymentVersion(version=1, model="tiny")]
        s.add(d)
        s.flush()
        for cid in ("east", "west", "x"):
            s.add(
                m.ReplicaAssignment(
                    replica_id=f"r-{cid}", deployment_id=d.id, version=1, cluster_id=cid, state="ready"
                )
            )
        s.commit()
        return read_snapshot(s)


def test_routes_carry_jurisdictions_and_no_policy_keeps_every_cluster(sessions):
    snap = _fleet(sessions)
    table = build_routes(snap, list(snap.assignments))["chat"]
    assert table.residency is None
    assert {(c.cluster, c.jurisdiction) for c in table.clusters} == {
        ("east", "ca"),
        ("west", "us"),
        ("x", ""),
    }
    for ranked in table.by_region.values():
        assert {(c.cluster, c.jurisdiction) for c in ranked} == {("east", "ca"), ("west", "us"), ("x", "")}


def test_a_bound_deployment_routes_only_inside_its_policy(sessions):
    snap = _fleet(sessions, residency=["ca"])
    table = build_routes(snap, list(snap.assignments))["chat"]
    assert table.residency == ["ca"]
    assert [c.cluster for c in table.clusters] == ["east"]
    assert set(table.by_region) == {"ca-east", "us-west", "r"}  # clients anywhere, servers inside
    assert all([c.cluster for c in ranked] == ["east"] for ranked in table.by_region.values())


def test_desired_state_carries_the_clusters_own_jurisdiction(sessions):
    snap = _fleet(sessions)
    desired = build_desired(snap, list(snap.assignments))
    assert {cid: d.jurisdiction for cid, d in desired.items()} == {"east": "ca", "west": "us", "x": ""}


def test_key_records_carry_the_keys_policy(sessions):
    with sessions() as s:
        s.add(m.ApiKey(key_id="k1", name="bound", salt="s", hash="h", residency=["ca", "us"]))
        s.add(m.ApiKey(key_id="k2", name="free", salt="s", hash="h"))
        s.commit()
        keys = {k.key_id: k for k in live_keys(s)}
    assert keys["k1"].residency == ["ca", "us"] and keys["k2"].residency is None


def test_key_records_carry_the_keys_team(sessions):
    with sessions() as s:
        s.add(m.ApiKey(key_id="k1", name="a", salt="s", hash="h", team="search"))
        s.add(m.ApiKey(key_id="k2", name="b", salt="s", hash="h"))
        s.commit()
        keys = {k.key_id: k for k in live_keys(s)}
    assert (keys["k1"].team, keys["k2"].team) == ("search", None)
    assert not keys["k1"].budget_exhausted


def test_usage_stores_where_a_request_was_processed(sessions):
    record = UsageRecord(cluster="east", key_id="k", deployment="chat", region="ca-east", jurisdiction="ca")
    old = UsageRecord(cluster="east", key_id="k", deployment="chat")  # an older gateway: unknown
    assert store_records(sessions, [record, old]) == 2
    with sessions() as s:
        rows = {r.record_id: (r.region, r.jurisdiction) for r in s.query(m.UsageRecord)}
    assert rows == {record.record_id: ("ca-east", "ca"), old.record_id: ("", "")}
