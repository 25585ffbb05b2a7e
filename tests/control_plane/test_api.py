"""The admin API over real HTTP against a real server process, on SQLite and on
PostgreSQL: every resource's CRUD, pagination and filters, versions, keys and auth,
events and the audit trail. Replica assignments (written by the control loops in a
full fleet) are inserted straight into the server's database where a test needs them.

Over ~400 lines: one server process per module (module-scoped) serves every resource's
tests; splitting would start more servers.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

import httpx
import pytest

from control_plane.db.models import ReplicaAssignment
from control_plane.db.session import make_sessions


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def db(cp_server):
    sessions = make_sessions(cp_server.database_url)
    yield sessions
    sessions.kw["bind"].dispose()


def assign(
    db, deployment_id: int, cluster: str, pool: str, *, version: int = 1, state: str = "ready", gpus: int = 1
) -> str:
    replica_id = uniq("r")
    with db() as s:
        s.add(
            ReplicaAssignment(
                replica_id=replica_id,
                deployment_id=deployment_id,
                version=version,
                cluster_id=cluster,
                pool_name=pool,
                gpus=gpus,
                state=state,
                url=f"http://127.0.0.1:9/{replica_id}",
            )
        )
        s.commit()
    return replica_id


def deployment_id(db, name: str) -> int:
    from sqlalchemy import select

    from control_plane.db.models import Deployment

    with db() as s:
        return s.scalar(select(Deployment.id).where(Deployment.name == name))


def ok(response: httpx.Response, status: int = 200) -> dict:
    assert response.status_code == status, response.text
    return response.json()


def test_health_and_openapi(cp_server):
    assert httpx.get(f"{cp_server.url}/healthz").json()["status"] == "ok"
    spec = httpx.get(f"{cp_server.url}/openapi.json").json()
    for path in (
        "/v1/deployments",
        "/v1/deployments/{name}/scale",
        "/v1/clusters",
        "/v1/pools",
        "/v1/keys",
        "/v1/events",
        "/v1/audit",
    ):
        assert path in spec["paths"]
    assert httpx.get(f"{cp_server.url}/docs").status_code == 200


def test_deployment_create_update_scale_versions_delete(admin, db):
    name = uniq("chat")
    created = ok(
        admin.post(
            "/v1/deployments",
            json={
                "name": name,
                "model": "smollm2-135m",
                "min_replicas": 1,
                "max_replicas": 4,
                "engine_args": {"max_num_seqs": 8},
                "gpu_models": ["L4"],
                "regions": ["eu-west", "us-east"],
                "min_regions": 2,
            },
        ),
        201,
    )
    assert created["name"] == name and created["current_version"] == 1
    assert created["desired_replicas"] == 1 and created["ready_replicas"] == 0 and created["placements"] == []
    assert [v["version"] for v in created["versions"]] == [1]
    assert created["spec"]["engine_args"] == {"max_num_seqs": 8} and created["spec"]["min_regions"] == 2

    # replicas alone pin the count
    pinned = ok(admin.post("/v1/deployments", json={"name": uniq("pin"), "model": "m", "replicas": 3}), 201)
    assert (pinned["desired_replicas"], pinned["min_replicas"], pinned["max_replicas"]) == (3, 3, 3)

    # scaling within the bounds changes no version
    scaled = ok(admin.post(f"/v1/deployments/{name}/scale", json={"replicas": 3}))
    assert scaled["desired_replicas"] == 3 and scaled["current_version"] == 1
    same = ok(admin.patch(f"/v1/deployments/{name}", json={"replicas": 2}))
    assert same["desired_replicas"] == 2 and len(same["versions"]) == 1
    unchanged = ok(admin.patch(f"/v1/deployments/{name}", json={"model": "smollm2-135m"}))
    assert unchanged["current_version"] == 1

    # a spec change makes version 2 and keeps the rest of the spec
    v2 = ok(
        admin.patch(f"/v1/deployments/{name}", json={"engine_args": {"max_num_seqs": 16}, "max_replicas": 6})
    )
    assert v2["current_version"] == 2 and [v["version"] for v in v2["versions"]] == [1, 2]
    assert v2["spec"]["engine_args"] == {"max_num_seqs": 16} and v2["spec"]["regions"] == [
        "eu-west",
        "us-east",
    ]
    assert v2["versions"][0]["engine_args"] == {"max_num_seqs": 8}  # old versions are immutable
    assert v2["desired_replicas"] == 2

    # tightening the bounds clamps the desired count into them
    v3 = ok(admin.patch(f"/v1/deployments/{name}", json={"min_replicas": 4, "max_replicas": 5}))
    assert v3["current_version"] == 3 and v3["desired_replicas"] == 4

    versions = ok(admin.get(f"/v1/deployments/{name}/versions"))
    assert versions["total"] == 3 and [v["current"] for v in versions["items"]] == [False, False, True]
    assert ok(admin.get(f"/v1/deployments/{name}/versions/2"))["engine_args"] == {"max_num_seqs": 16}
    assert admin.get(f"/v1/deployments/{name}/versions/9").status_code == 404

    # a version in use cannot be deleted; an unused old one can
    dep_id = deployment_id(db, name)
    assign(db, dep_id, _cluster(admin), "gpus", version=2)
    assert admin.delete(f"/v1/deployments/{name}/versions/3").status_code == 409  # current
    assert admin.delete(f"/v1/deployments/{name}/versions/2").status_code == 409  # has a replica
    ok(admin.delete(f"/v1/deployments/{name}/versions/1"))
    assert [v["version"] for v in ok(admin.get(f"/v1/deployments/{name}"))["versions"]] == [2, 3]

    gone = ok(admin.delete(f"/v1/deployments/{name}"))
    assert gone["name"] == name and len(gone["placements"]) == 1
    assert admin.get(f"/v1/deployments/{name}").status_code == 404
    assert admin.delete(f"/v1/deployments/{name}").status_code == 404
    # the replica went with it (cascade)
    with db() as s:
        assert s.query(ReplicaAssignment).filter_by(deployment_id=dep_id).count() == 0


def test_priority_and_surge_budget_are_per_deployment(admin):
    name = uniq("prio")
    created = ok(admin.post("/v1/deployments", json={"name": name, "model": "m", "replicas": 4}), 201)
    assert (created["priority"], created["max_surge"], created["max_unavailable"]) == (
        "standard",
        "25%",
        "25%",
    )
    body = {"priority": "batch", "max_surge": 0, "max_unavailable": "50%"}
    updated = ok(admin.patch(f"/v1/deployments/{name}", json=body))
    assert (updated["priority"], updated["max_surge"], updated["max_unavailable"]) == ("batch", "0", "50%")
    assert updated["current_version"] == 1  # not a spec change: no new version, no rollout
    scaled = ok(admin.post(f"/v1/deployments/{name}/scale", json={"replicas": 4, "priority": "critical"}))
    assert scaled["priority"] == "critical"
    for bad in ({"priority": "urgent"}, {"max_surge": "150%"}, {"max_unavailable": "x"}, {"max_surge": -1}):
        r = admin.patch(f"/v1/deployments/{name}", json=bad)
        assert r.status_code == 422, (bad, r.text)
    r = admin.patch(f"/v1/deployments/{name}", json={"max_unavailable": "0%"})  # with max_surge 0
    assert r.status_code == 422 and "both be 0" in r.text


def test_name_taken_is_409(admin):
    name = uniq("dup")
    ok(admin.post("/v1/deployments", json={"name": name, "model": "m"}), 201)
    res = admin.post("/v1/deployments", json={"name": name, "model": "other"})
    assert res.status_code == 409 and res.json()["error"]["field"] == "name"


def test_deployment_list_pagination_and_filters(admin):
    model = uniq("model")
    names = sorted(uniq("page") for _ in range(5))
    for n in names:
        ok(admin.post("/v1/deployments", json={"name": n, "model": model}), 201)
    everything = ok(admin.get("/v1/deployments", params={"model": model}))
    assert everything["total"] == 5 and [d["name"] for d in everything["items"]] == names
    pages = [
        ok(admin.get("/v1/deployments", params={"model": model, "limit": 2, "offset": o})) for o in (0, 2, 4)
    ]
    assert [[d["name"] for d in p["items"]] for p in pages] == [names[:2], names[2:4], names[4:]]
    assert all(p["total"] == 5 and p["limit"] == 2 for p in pages)
    assert ok(admin.get("/v1/deployments", params={"model": uniq("none")}))["items"] == []
    by_prefix = ok(admin.get("/v1/deployments", params={"name_prefix": names[0]}))
    assert [d["name"] for d in by_prefix["items"]] == [names[0]]
    # a model filter follows the current version
    ok(admin.patch(f"/v1/deployments/{names[0]}", json={"model": uniq("model")}))
    assert ok(admin.get("/v1/deployments", params={"model": model}))["total"] == 4


def _cluster(admin, region: str = "eu-west", **extra) -> str:
    cid = uniq("c")
    ok(
        admin.post(
            "/v1/clusters",
            json={
                "id": cid,
                "provider": "gcp",
                "region": region,
                "lat": 50.1,
                "lon": 8.6,
                "gateway_url": "http://127.0.0.1:9",
                "pools": [
                    {
                        "name": "gpus",
                        "gpu_model": "L4",
                        "gpu_memory_gb": 24,
                        "gpus_per_node": 4,
                        "nodes": 2,
                        "tier": "spot",
                        "hourly_price": 2.5,
                    },
                ],
                **extra,
            },
        ),
        201,
    )
    return cid


def test_status_view_counts_ready_replicas_and_placements(admin, db):
    cid = _cluster(admin, region="us-east")
    name = uniq("st")
    ok(
        admin.post(
            "/v1/deployments", json={"name": name, "model": "m", "min_replicas": 1, "max_replicas": 3}
        ),
        201,
    )
    ok(admin.post(f"/v1/deployments/{name}/scale", json={"replicas": 3}))
    dep = deployment_id(db, name)
    ready = [assign(db, dep, cid, "gpus", state="ready") for _ in range(2)]
    starting = assign(db, dep, cid, "gpus", state="starting", gpus=2)
    status = ok(admin.get(f"/v1/deployments/{name}"))
    assert status["desired_replicas"] == 3 and status["ready_replicas"] == 2
    placements = {p["replica_id"]: p for p in status["placements"]}
    assert set(placements) == {*ready, starting}
    assert placements[starting] | {"url": ""} == {
        "replica_id": starting,
        "cluster": cid,
        "region": "us-east",
        "pool": "gpus",
        "version": 1,
        "state": "starting",
        "url": "",
        "gpus": 2,
        "startup": {},  # no heartbeat has reported its cold start yet
    }
    assert status["versions"][0]["replicas"] == 3
    listed = [d for d in ok(admin.get("/v1/deployments", params={"name_prefix": name}))["items"]]
    assert listed[0]["ready_replicas"] == 2 and listed[0]["desired_replicas"] == 3
    # pools count the GPUs in use; the cluster cannot go while replicas are assigned
    pool = ok(admin.get("/v1/pools", params={"cluster": cid}))["items"][0]
    assert (pool["total_gpus"], pool["used_gpus"], pool["free_gpus"]) == (8, 4, 4)
    assert ok(admin.get(f"/v1/clusters/{cid}"))["replicas"] == 3
    res = admin.delete(f"/v1/clusters/{cid}")
    assert res.status_code == 409 and "3 replica(s)" in res.json()["error"]["message"]
    assert admin.delete(f"/v1/clusters/{cid}/pools/gpus").status_code == 409
    ok(admin.delete(f"/v1/deployments/{name}"))
    ok(admin.delete(f"/v1/clusters/{cid}"))


def test_clusters_and_pools(admin, db):
    a = _cluster(admin, region="eu-west")
    b = _cluster(admin, region="ap-south")
    assert admin.post("/v1/clusters", json={"id": a}).status_code == 409
    one = ok(admin.get(f"/v1/clusters/{a}"))
    assert one["provider"] == "gcp" and one["status"] == "healthy" and one["last_heartbeat_at"] is None
    assert one["pools"][0] | {} == {
        "cluster": a,
        "region": "eu-west",
        "jurisdiction": "",
        "name": "gpus",
        "gpu_model": "L4",
        "gpu_memory_gb": 24.0,
        "gpus_per_node": 4,
        "nodes": 2,
        "tier": "spot",
        "hourly_price": 2.5,
        "total_gpus": 8,
        "used_gpus": 0,
        "free_gpus": 8,
    }
    in_ap = ok(admin.get("/v1/clusters", params={"region": "ap-south"}))["items"]
    assert b in [c["id"] for c in in_ap] and a not in [c["id"] for c in in_ap]

    cordoned = ok(admin.patch(f"/v1/clusters/{a}", json={"status": "draining"}))
    assert cordoned["status"] == "draining"
    draining = [c["id"] for c in ok(admin.get("/v1/clusters", params={"status": "draining"}))["items"]]
    assert a in draining and b not in draining
    ok(admin.patch(f"/v1/clusters/{a}", json={"status": "healthy", "gateway_url": "http://10.0.0.1:8080"}))
    assert ok(admin.get(f"/v1/clusters/{a}"))["gateway_url"] == "http://10.0.0.1:8080"

    created = ok(
        admin.post(
            f"/v1/clusters/{b}/pools",
            json={
                "name": "h100-reserved",
                "gpu_model": "H100",
                "gpu_memory_gb": 80,
                "gpus_per_node": 8,
                "nodes": 1,
                "tier": "reserved",
                "hourly_price": 98.0,
            },
        ),
        201,
    )
    assert created["free_gpus"] == 8 and created["region"] == "ap-south"
    assert (
        admin.post(f"/v1/clusters/{b}/pools", json={"name": "h100-reserved", "gpu_model": "H100"}).status_code
        == 409
    )
    assert (
        admin.post(f"/v1/clusters/{uniq('x')}/pools", json={"name": "p", "gpu_model": "H100"}).status_code
        == 404
    )
    h100 = ok(admin.get("/v1/pools", params={"gpu_model": "H100", "tier": "reserved"}))["items"]
    assert [(p["cluster"], p["name"]) for p in h100 if p["cluster"] == b] == [(b, "h100-reserved")]
    assert all(p["gpu_model"] == "H100" and p["tier"] == "reserved" for p in h100)
    spot_b = ok(admin.get("/v1/pools", params={"cluster": b, "tier": "spot"}))["items"]
    assert [p["name"] for p in spot_b] == ["gpus"]
    ok(admin.delete(f"/v1/clusters/{b}/pools/h100-reserved"))
    assert admin.delete(f"/v1/clusters/{b}/pools/h100-reserved").status_code == 404
    assert [p["name"] for p in ok(admin.get(f"/v1/clusters/{b}"))["pools"]] == ["gpus"]

    # an unhealthy cluster may be cordoned, but only a heartbeat makes it healthy
    from control_plane.db.models import Cluster

    with db() as s:
        s.get(Cluster, b).status = "unhealthy"
        s.commit()
    res = admin.patch(f"/v1/clusters/{b}", json={"status": "healthy"})
    assert res.status_code == 409 and "heartbeat" in res.json()["error"]["message"]
    assert ok(admin.patch(f"/v1/clusters/{b}", json={"status": "draining"}))["status"] == "draining"

    ok(admin.delete(f"/v1/clusters/{b}"))
    assert admin.get(f"/v1/clusters/{b}").status_code == 404
    assert ok(admin.get("/v1/pools", params={"cluster": b}))["total"] == 0  # pools went with it


def test_keys_secret_once_scopes_and_revocation(cp_server, admin):
    created = ok(admin.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}), 201)
    secret, key_id = created["key"], created["key_id"]
    assert secret.startswith(f"fleet-{key_id}-") and created["scopes"] == ["read"] and not created["revoked"]
    listed = ok(admin.get("/v1/keys"))["items"]
    row = next(k for k in listed if k["key_id"] == key_id)
    assert not {"key", "hash", "salt"} & set(row) and secret not in str(listed)
    assert "key" not in ok(admin.get(f"/v1/keys/{key_id}"))

    with cp_server.client(secret) as reader:
        assert reader.get("/v1/deployments").status_code == 200
        denied = reader.post("/v1/deployments", json={"name": uniq("r"), "model": "m"})
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "forbidden"
        assert reader.delete(f"/v1/keys/{key_id}").status_code == 403

        inference = ok(
            admin.post(
                "/v1/keys",
                json={
                    "name": "app",
                    "deployments": ["chat"],
                    "quotas": {"tokens_per_minute": 1000, "priority": 2},
                },
            ),
            201,
        )
        assert inference["scopes"] == ["inference"] and inference["deployments"] == ["chat"]
        assert inference["quotas"]["tokens_per_minute"] == 1000 and inference["quotas"]["priority"] == 2
        with cp_server.client(inference["key"]) as app_client:
            assert app_client.get("/v1/deployments").status_code == 403

        revoked = ok(admin.delete(f"/v1/keys/{key_id}"))
        assert revoked["revoked"] and revoked["revoked_at"]
        refused = reader.get("/v1/deployments")  # revocation is immediate in-process
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert ok(admin.delete(f"/v1/keys/{key_id}"))["revoked"]  # idempotent
    active = ok(admin.get("/v1/keys", params={"include_revoked": "false"}))["items"]
    assert key_id not in [k["key_id"] for k in active]
    assert admin.delete(f"/v1/keys/{uniq('nokey')}").status_code == 404

    trail = ok(admin.get("/v1/audit", params={"resource_type": "key", "resource_id": key_id}))["items"]
    assert [a["action"] for a in trail] == ["key.revoke", "key.create"]
    assert trail[0]["before"]["revoked"] is False and trail[0]["after"]["revoked"] is True
    assert "admin" in trail[0]["actor"] and secret not in str(trail)


def test_events_and_audit_of_writes(admin):
    name = uniq("ev")
    t0 = time.time()
    ok(
        admin.post(
            "/v1/deployments", json={"name": name, "model": "m", "min_replicas": 1, "max_replicas": 2}
        ),
        201,
    )
    ok(admin.post(f"/v1/deployments/{name}/scale", json={"replicas": 2}))
    ok(admin.patch(f"/v1/deployments/{name}", json={"model": "m2"}))
    ok(admin.delete(f"/v1/deployments/{name}"))

    events = ok(admin.get("/v1/events", params={"deployment": name}))
    assert [e["kind"] for e in events["items"]] == [
        "deployment_deleted",
        "deployment_updated",
        "scaled",
        "deployment_created",
    ]
    assert "1 -> 2" in events["items"][2]["message"]
    assert ok(admin.get("/v1/events", params={"deployment": name, "kind": "scaled"}))["total"] == 1
    paged = ok(admin.get("/v1/events", params={"deployment": name, "limit": 1, "offset": 1}))
    assert paged["total"] == 4 and [e["kind"] for e in paged["items"]] == ["deployment_updated"]
    since = ok(admin.get("/v1/events", params={"deployment": name, "since": t0 - 1}))
    assert since["total"] == 4
    later = datetime.fromtimestamp(time.time() + 60, tz=timezone.utc).isoformat()
    assert ok(admin.get("/v1/events", params={"deployment": name, "since": later}))["total"] == 0

    audit = ok(admin.get("/v1/audit", params={"resource_type": "deployment", "resource_id": name}))["items"]
    assert [a["action"] for a in audit] == [
        "deployment.delete",
        "deployment.update",
        "deployment.scale",
        "deployment.create",
    ]
    create, scale, update, delete = audit[::-1]
    assert create["before"] is None and create["after"]["name"] == name
    assert scale["before"] == {"replicas": 1} and scale["after"] == {"replicas": 2}
    assert update["before"]["model"] == "m" and update["after"]["model"] == "m2"
    assert update["after"]["current_version"] == 2
    assert delete["after"] is None and delete["before"]["current_version"] == 2
    assert all(a["actor"].endswith(")") for a in audit)
    one = ok(admin.get("/v1/audit", params={"action": "deployment.scale", "resource_id": name}))
    assert one["total"] == 1


def test_lora_adapters_are_per_deployment_and_unversioned(admin):
    name = uniq("lora")
    body = {"name": name, "model": "m", "adapters": [{"name": "sql", "uri": "/models/sql"}]}
    created = ok(admin.post("/v1/deployments", json=body), 201)
    assert created["adapters"] == [{"name": "sql", "uri": "/models/sql"}]
    assert created["max_adapters"] == 4  # adapters without room get the default
    added = ok(admin.post(f"/v1/deployments/{name}/adapters", json={"name": "chat", "uri": "/m/chat"}), 201)
    assert [a["name"] for a in added["adapters"]] == ["sql", "chat"]
    r = admin.post(f"/v1/deployments/{name}/adapters", json={"name": "chat", "uri": "/m/x"})
    assert r.status_code == 409
    for bad in ({"name": "bad name", "uri": "/x"}, {"name": "x"}, {"name": "x", "uri": "s3://"}):
        r = admin.post(f"/v1/deployments/{name}/adapters", json=bad)
        assert r.status_code == 422, (bad, r.text)
    updated = ok(admin.patch(f"/v1/deployments/{name}", json={"max_adapters": 2}))
    assert updated["max_adapters"] == 2 and updated["current_version"] == 1  # no rollout
    removed = ok(admin.delete(f"/v1/deployments/{name}/adapters/sql"))
    assert [a["name"] for a in removed["adapters"]] == ["chat"]
    assert admin.delete(f"/v1/deployments/{name}/adapters/sql").status_code == 404
    dup = {"adapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]}
    assert admin.patch(f"/v1/deployments/{name}", json=dup).status_code == 422
    assert ok(admin.get(f"/v1/deployments/{name}/adapters"))["adapters"] == [
        {"name": "chat", "uri": "/m/chat"}
    ]


def test_residency_fields_on_clusters_deployments_keys_and_usage(admin, db):
    cid = uniq("ca")
    cluster = ok(
        admin.post("/v1/clusters", json={"id": cid, "region": "ca-east", "jurisdiction": " CA "}), 201
    )
    assert cluster["jurisdiction"] == "ca"
    ok(admin.post(f"/v1/clusters/{cid}/pools", json={"name": "p", "gpu_model": "cpu"}), 201)
    assert [p["jurisdiction"] for p in ok(admin.get("/v1/pools", params={"cluster": cid}))["items"]] == ["ca"]
    assert ok(admin.patch(f"/v1/clusters/{cid}", json={"jurisdiction": "us"}))["jurisdiction"] == "us"
    assert ok(admin.get("/v1/events", params={"cluster": cid, "kind": "cluster_jurisdiction"}))["total"] == 1
    assert ok(admin.patch(f"/v1/clusters/{cid}", json={"jurisdiction": ""}))["jurisdiction"] == ""
    imported = {
        "provider": "cat",
        "pools": [{"region": cid, "name": "p", "gpu_model": "cpu", "jurisdiction": "eu"}],
    }
    clusters = ok(admin.post("/v1/pools/import", json=imported))["clusters"]
    assert ok(admin.get(f"/v1/clusters/{clusters[0]}"))["jurisdiction"] == "eu"

    name = uniq("bound")
    dep = ok(
        admin.post("/v1/deployments", json={"name": name, "model": "m", "residency": ["ca", "US", "ca"]}), 201
    )
    assert dep["residency"] == ["ca", "us"]
    assert ok(admin.patch(f"/v1/deployments/{name}", json={"replicas": 1}))["residency"] == ["ca", "us"]
    updated = ok(admin.patch(f"/v1/deployments/{name}", json={"residency": ["eu"]}))
    assert updated["residency"] == ["eu"] and updated["current_version"] == 1  # no new version
    listed = ok(admin.get("/v1/deployments", params={"name_prefix": name}))["items"]
    assert [d["residency"] for d in listed] == [["eu"]]
    assert ok(admin.patch(f"/v1/deployments/{name}", json={"residency": None}))["residency"] is None

    key = ok(admin.post("/v1/keys", json={"name": "bound", "residency": ["ca"]}), 201)
    assert key["residency"] == ["ca"] and ok(admin.get(f"/v1/keys/{key['key_id']}"))["residency"] == ["ca"]
    assert ok(admin.patch(f"/v1/keys/{key['key_id']}", json={"residency": ["ca", "us"]}))["residency"] == [
        "ca",
        "us",
    ]
    assert ok(admin.patch(f"/v1/keys/{key['key_id']}", json={"name": "b2"}))["residency"] == ["ca", "us"]
    assert ok(admin.patch(f"/v1/keys/{key['key_id']}", json={"residency": None}))["residency"] is None

    # bad labels and empty policies are 422s naming the field, never 500s
    for path, method, body, field in (
        ("/v1/clusters", "post", {"id": uniq("x"), "jurisdiction": "c a"}, "jurisdiction"),
        (f"/v1/clusters/{cid}", "patch", {"jurisdiction": "x" * 33}, "jurisdiction"),
        ("/v1/deployments", "post", {"name": uniq("d"), "model": "m", "residency": []}, "residency"),
        ("/v1/deployments", "post", {"name": uniq("d"), "model": "m", "residency": "ca"}, "residency"),
        (f"/v1/deployments/{name}", "patch", {"residency": ["ca_east"]}, "residency"),
        ("/v1/keys", "post", {"name": "k", "residency": ["é"]}, "residency"),
        (f"/v1/keys/{key['key_id']}", "patch", {"residency": []}, "residency"),
    ):
        res = getattr(admin, method)(path, json=body)
        assert res.status_code == 422 and field in (res.json()["error"]["field"] or ""), (body, res.text)

    # usage says where requests were processed, and filters by it
    from control_plane.db.models import UsageRecord

    with db() as s:
        for region, jurisdiction in (("ca-east", "ca"), ("ca-east", "ca"), ("us-west", "us"), ("", "")):
            s.add(
                UsageRecord(
                    at=datetime.now(timezone.utc), cluster=cid, key_id=key["key_id"], deployment=name,
                    prompt_tokens=1, completion_tokens=1, region=region, jurisdiction=jurisdiction,
                )
            )  # fmt: skip
        s.commit()
    row = ok(admin.get("/v1/usage", params={"key": key["key_id"]}))["items"][0]
    assert row["regions"] == {"ca-east": 2, "us-west": 1, "": 1} and row["jurisdictions"] == {
        "ca": 2,
        "us": 1,
        "": 1,
    }
    only = ok(admin.get("/v1/usage", params={"key": key["key_id"], "jurisdiction": "us"}))["items"]
    assert [(r["requests"], r["regions"]) for r in only] == [(1, {"us-west": 1})]
