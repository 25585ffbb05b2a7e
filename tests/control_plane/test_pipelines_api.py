"""The pipelines API over real HTTP against a real server process, on SQLite and on
PostgreSQL: create (and every way it is refused), list, per-cluster readiness of every
step from the stored replica states, delete, scopes, the audit trail, and a deployment
that is a step refusing deletion. Replica assignments are inserted straight into the
database, as in test_api."""

from __future__ import annotations

import pytest

from tests.control_plane.test_api import _cluster, assign, db, deployment_id, ok, uniq  # noqa: F401


def _deployments(admin, *prefixes: str) -> list[str]:
    names = [uniq(p) for p in prefixes]
    for name in names:
        ok(admin.post("/v1/deployments", json={"name": name, "model": "m", "max_replicas": 4}), 201)
    return names


def test_create_get_readiness_and_delete(admin, db):  # noqa: F811
    emb, chat = _deployments(admin, "emb", "chat")
    a, b = _cluster(admin, region="eu-west"), _cluster(admin, region="us-east")
    name = uniq("rag")
    body = {
        "name": name,
        "steps": [{"name": "embed", "deployment": emb}, {"name": "answer", "deployment": chat}],
    }
    created = ok(admin.post("/v1/pipelines", json=body | {"slo_e2e_s": 0.8}), 201)
    assert created["steps"] == body["steps"] and created["slo_e2e_s"] == 0.8
    assert created["ready_clusters"] == []

    # a: both steps ready; b: chat's only replica is starting, embed ready twice
    assign(db, deployment_id(db, emb), a, "gpus")
    assign(db, deployment_id(db, chat), a, "gpus")
    assign(db, deployment_id(db, chat), a, "gpus", state="starting")
    for _ in range(2):
        assign(db, deployment_id(db, emb), b, "gpus")
    assign(db, deployment_id(db, chat), b, "gpus", state="starting")

    got = ok(admin.get(f"/v1/pipelines/{name}"))
    mine = {c["cluster"]: c for c in got["clusters"] if c["cluster"] in (a, b)}
    assert mine == {
        a: {"cluster": a, "region": "eu-west", "ready": True, "steps": {"embed": 1, "answer": 1}},
        b: {"cluster": b, "region": "us-east", "ready": False, "steps": {"embed": 2, "answer": 0}},
    }
    assert got["ready_clusters"] == [a]
    assert all(not c["ready"] for c in got["clusters"] if c["cluster"] not in (a, b))

    listed = ok(admin.get("/v1/pipelines"))
    row = next(p for p in listed["items"] if p["name"] == name)
    assert row["ready_clusters"] == [a] and "clusters" not in row

    # a step's deployment cannot go while the pipeline names it
    refused = admin.delete(f"/v1/deployments/{chat}")
    assert refused.status_code == 409 and name in refused.json()["error"]["message"]

    deleted = ok(admin.delete(f"/v1/pipelines/{name}"))
    assert deleted["name"] == name
    assert admin.get(f"/v1/pipelines/{name}").status_code == 404
    assert admin.delete(f"/v1/pipelines/{name}").status_code == 404
    trail = ok(admin.get("/v1/audit", params={"resource_type": "pipeline", "resource_id": name}))["items"]
    assert sorted(r["action"] for r in trail) == ["pipeline.create", "pipeline.delete"]
    ok(admin.delete(f"/v1/deployments/{chat}"))  # no pipeline names it now


def test_duplicate_name_is_409(admin):
    (emb,) = _deployments(admin, "emb")
    body = {"name": uniq("p"), "steps": [{"name": "embed", "deployment": emb}]}
    ok(admin.post("/v1/pipelines", json=body), 201)
    res = admin.post("/v1/pipelines", json=body)
    assert res.status_code == 409 and res.json()["error"]["field"] == "name"


@pytest.mark.parametrize(
    ("steps", "extra", "reason"),
    [
        ([{"name": "embed", "deployment": "nope-{u}"}], {}, "not found: embed -> nope-"),
        (
            [{"name": "a", "deployment": "{emb}"}, {"name": "a", "deployment": "{chat}"}],
            {},
            "step names repeat",
        ),
        (
            [{"name": "a", "deployment": "{emb}"}, {"name": "b", "deployment": "{emb}"}],
            {},
            "one step per pipeline",
        ),
        ([], {}, "steps"),
        ([{"name": "a", "deployment": "{emb}"}], {"slo_e2e_s": 0}, "slo_e2e_s"),
        ([{"name": "a", "deployment": "{emb}"}], {"slo_e2e_s": "0.8"}, "slo_e2e_s"),
        ([{"name": "a", "deployment": "{emb}", "gpu": 1}], {}, "unknown field"),
        ([{"name": "A b", "deployment": "{emb}"}], {}, "steps.0.name"),
    ],
)
def test_bad_pipelines_are_422_with_a_reason(admin, steps, extra, reason):
    emb, chat = _deployments(admin, "emb", "chat")
    u = uniq("x")
    steps = [
        {k: v.format(emb=emb, chat=chat, u=u) if isinstance(v, str) else v for k, v in s.items()}
        for s in steps
    ]
    res = admin.post("/v1/pipelines", json={"name": uniq("bad"), "steps": steps, **extra})
    assert res.status_code == 422, res.text
    assert reason in res.json()["error"]["message"]


def test_read_scope_reads_and_cannot_write(cp_server, admin):
    (emb,) = _deployments(admin, "emb")
    name = uniq("p")
    ok(admin.post("/v1/pipelines", json={"name": name, "steps": [{"name": "e", "deployment": emb}]}), 201)
    secret = ok(admin.post("/v1/keys", json={"name": "reader", "scopes": ["read"]}), 201)["key"]
    with cp_server.client(secret) as reader:
        assert ok(reader.get(f"/v1/pipelines/{name}"))["name"] == name
        assert reader.get("/v1/pipelines").status_code == 200
        assert reader.delete(f"/v1/pipelines/{name}").status_code == 403
        body = {"name": uniq("p"), "steps": [{"name": "e", "deployment": emb}]}
        assert reader.post("/v1/pipelines", json=body).status_code == 403
    with cp_server.client("fleet-nope-nope") as stranger:
        assert stranger.get("/v1/pipelines").status_code == 401


@pytest.mark.parametrize(
    ("path", "status"), [("%00", 400), ("Not_A_Name", 422), ("a" * 64, 422), ("%F0%9F%98%80", 422)]
)
def test_a_name_no_pipeline_can_have_is_4xx_before_any_query(admin, path, status):
    """A control character is refused for every path (400), a bad name by the route (422)."""
    for method in ("GET", "DELETE"):
        res = admin.request(method, f"/v1/pipelines/{path}")
        assert res.status_code == status, (method, path, res.text)


def test_requests_say_where_each_hop_ran_from_the_usage_records(admin, db):  # noqa: F811
    """Hop records stored by the usage loop's own writer come back grouped by pipeline
    request; a request whose hops ran in two clusters is counted as split."""
    from control_plane.loops.usage import store_records
    from fleet_base.protocol import UsageRecord

    emb, chat = _deployments(admin, "emb", "chat")
    name = uniq("rag")
    steps = [{"name": "embed", "deployment": emb}, {"name": "answer", "deployment": chat}]
    ok(admin.post("/v1/pipelines", json={"name": name, "steps": steps}), 201)

    def hop(request: str, step: str, deployment: str, cluster: str, status: int = 200) -> UsageRecord:
        return UsageRecord(
            cluster=cluster, key_id="k1", deployment=deployment, latency_s=0.1, status=status,
            pipeline=name, pipeline_step=step, pipeline_request=request,
        )  # fmt: skip

    records = [
        hop("east.1", "embed", emb, "east"), hop("east.1", "answer", chat, "east"),
        hop("west.2", "embed", emb, "west"), hop("west.2", "answer", chat, "west"),
        hop("east.3", "embed", emb, "east"), hop("east.3", "answer", chat, "west"),
        # west's gateway refused one hop (quota) and failed to forward another: not where it ran
        hop("east.4", "embed", emb, "west", 429), hop("east.4", "embed", emb, "east"),
        hop("east.4", "answer", chat, "west", 502), hop("east.4", "answer", chat, "east"),
        UsageRecord(cluster="east", key_id="k1", deployment=chat),  # not a pipeline hop
    ]  # fmt: skip
    assert store_records(db, records) == len(records)

    got = ok(admin.get(f"/v1/pipelines/{name}/requests", params={"since": "1h"}))
    assert (got["requests"], got["split"], got["by_cluster"]) == (4, 1, {"east": 2, "west": 1})
    by_id = {i["request"]: i for i in got["items"]}
    assert by_id["east.3"]["clusters"] == ["east", "west"] and by_id["east.3"]["split"]
    four = by_id["east.4"]
    assert (four["clusters"], four["split"], four["refused_hops"], len(four["hops"])) == (
        ["east"],
        False,
        2,
        4,
    )
    assert by_id["east.1"]["refused_hops"] == 0
    assert [(h["step"], h["cluster"]) for h in by_id["west.2"]["hops"]] == [
        ("embed", "west"),
        ("answer", "west"),
    ]
    assert admin.get(f"/v1/pipelines/{uniq('nope')}/requests").status_code == 404
    assert admin.get(f"/v1/pipelines/{name}/requests", params={"since": "soon"}).status_code == 422
