"""Every kind of bad input to the admin API gets the right 4xx with a reason naming the
field, never a 500; unauthenticated calls get 401 and wrong scopes 403. Runs against a
real server on SQLite and on PostgreSQL (where overflowing integers would otherwise
surface as database errors)."""

from __future__ import annotations

import json

import pytest

TARGET = "bad-target"
CLUSTER = "bad-cluster"

OK_DEPLOYMENT = {"name": "fresh", "model": "m"}


def dep(**fields):
    return {**OK_DEPLOYMENT, **fields}


# (id, method, path, body: dict | list | str (raw) | None, status, field or None)
CASES = [
    ("garbage-json", "POST", "/v1/deployments", "{not json", 400, None),
    ("truncated-json", "POST", "/v1/deployments", '{"name": "x", ', 400, None),
    ("list-body", "POST", "/v1/deployments", [], 422, None),
    ("empty-body", "POST", "/v1/deployments", "", 422, None),
    ("missing-model", "POST", "/v1/deployments", {"name": "x"}, 422, "model"),
    ("missing-name", "POST", "/v1/deployments", {"model": "m"}, 422, "name"),
    ("name-uppercase", "POST", "/v1/deployments", dep(name="Bad_Name"), 422, "name"),
    ("name-too-long", "POST", "/v1/deployments", dep(name="a" * 64), 422, "name"),
    ("name-empty", "POST", "/v1/deployments", dep(name=""), 422, "name"),
    ("name-dot", "POST", "/v1/deployments", dep(name="a.b"), 422, "name"),
    ("name-number", "POST", "/v1/deployments", dep(name=7), 422, "name"),
    ("model-empty", "POST", "/v1/deployments", dep(model=""), 422, "model"),
    ("model-huge", "POST", "/v1/deployments", dep(model="m" * 600), 422, "model"),
    ("replicas-string", "POST", "/v1/deployments", dep(replicas="3"), 422, "replicas"),
    ("replicas-negative", "POST", "/v1/deployments", dep(replicas=-1), 422, "replicas"),
    ("replicas-huge", "POST", "/v1/deployments", dep(replicas=10**12), 422, "replicas"),
    ("replicas-float", "POST", "/v1/deployments", dep(replicas=1.5), 422, "replicas"),
    ("replicas-bool", "POST", "/v1/deployments", dep(replicas=True), 422, "replicas"),
    ("min-over-max", "POST", "/v1/deployments", dep(min_replicas=3, max_replicas=1), 422, "min_replicas"),
    (
        "replicas-outside",
        "POST",
        "/v1/deployments",
        dep(replicas=5, min_replicas=1, max_replicas=3),
        422,
        "replicas",
    ),
    ("gpu-count-zero", "POST", "/v1/deployments", dep(gpu_count=0), 422, "gpu_count"),
    ("gpu-count-huge", "POST", "/v1/deployments", dep(gpu_count=65), 422, "gpu_count"),
    ("gpu-memory-negative", "POST", "/v1/deployments", dep(gpu_memory_gb=-1), 422, "gpu_memory_gb"),
    ("gpu-memory-huge", "POST", "/v1/deployments", dep(gpu_memory_gb=1e308), 422, "gpu_memory_gb"),
    (
        "gpu-memory-nan",
        "POST",
        "/v1/deployments",
        '{"name": "x", "model": "m", "gpu_memory_gb": NaN}',
        422,
        "gpu_memory_gb",
    ),
    ("gpu-models-not-list", "POST", "/v1/deployments", dep(gpu_models="L4"), 422, "gpu_models"),
    ("gpu-models-duplicate", "POST", "/v1/deployments", dep(gpu_models=["L4", "L4"]), 422, "gpu_models"),
    ("unknown-field", "POST", "/v1/deployments", dep(colour="blue"), 422, "colour"),
    ("engine-args-list-value", "POST", "/v1/deployments", dep(engine_args={"x": [1, 2]}), 422, "engine_args"),
    ("engine-args-not-object", "POST", "/v1/deployments", dep(engine_args="--x 1"), 422, "engine_args"),
    ("engine-args-bad-key", "POST", "/v1/deployments", dep(engine_args={"--bad key": 1}), 422, "engine_args"),
    ("regions-not-list", "POST", "/v1/deployments", dep(regions="eu"), 422, "regions"),
    ("regions-duplicate", "POST", "/v1/deployments", dep(regions=["eu", "eu"]), 422, "regions"),
    (
        "min-regions-over",
        "POST",
        "/v1/deployments",
        dep(regions=["eu", "us"], min_regions=3),
        422,
        "min_regions",
    ),
    ("min-regions-zero", "POST", "/v1/deployments", dep(min_regions=0), 422, "min_regions"),
    ("scale-to-zero-string", "POST", "/v1/deployments", dep(scale_to_zero="yes"), 422, "scale_to_zero"),
    (
        "target-concurrency-zero",
        "POST",
        "/v1/deployments",
        dep(target_concurrency=0),
        422,
        "target_concurrency",
    ),
    ("window-negative", "POST", "/v1/deployments", dep(autoscale_window_s=-5), 422, "autoscale_window_s"),
    ("name-taken", "POST", "/v1/deployments", dep(name=TARGET), 409, "name"),
    # scale and update
    ("scale-outside", "POST", f"/v1/deployments/{TARGET}/scale", {"replicas": 9}, 422, "replicas"),
    ("scale-missing", "POST", f"/v1/deployments/{TARGET}/scale", {}, 422, "replicas"),
    ("scale-negative", "POST", f"/v1/deployments/{TARGET}/scale", {"replicas": -2}, 422, "replicas"),
    ("scale-unknown", "POST", "/v1/deployments/nope-nope/scale", {"replicas": 1}, 404, None),
    ("patch-unknown", "PATCH", "/v1/deployments/nope-nope", {"replicas": 1}, 404, None),
    ("patch-min-over-max", "PATCH", f"/v1/deployments/{TARGET}", {"min_replicas": 5}, 422, "min_replicas"),
    ("patch-replicas-outside", "PATCH", f"/v1/deployments/{TARGET}", {"replicas": 7}, 422, "replicas"),
    ("patch-rename", "PATCH", f"/v1/deployments/{TARGET}", {"name": "other"}, 422, "name"),
    ("get-unknown", "GET", "/v1/deployments/nope-nope", None, 404, None),
    ("get-nul-name", "GET", "/v1/deployments/a%00b", None, 400, None),
    ("delete-nul-name", "DELETE", "/v1/deployments/a%00b", None, 400, None),
    ("model-nul", "POST", "/v1/deployments", dep(model="m\u0000x"), 422, "model"),
    ("delete-unknown", "DELETE", "/v1/deployments/nope-nope", None, 404, None),
    ("version-not-int", "GET", f"/v1/deployments/{TARGET}/versions/abc", None, 422, "version"),
    ("version-zero", "GET", f"/v1/deployments/{TARGET}/versions/0", None, 422, "version"),
    ("version-huge", "GET", f"/v1/deployments/{TARGET}/versions/99999999999999999999", None, 422, "version"),
    ("version-current-delete", "DELETE", f"/v1/deployments/{TARGET}/versions/1", None, 409, "version"),
    # paging and filters
    ("limit-zero", "GET", "/v1/deployments?limit=0", None, 422, "limit"),
    ("limit-huge", "GET", "/v1/deployments?limit=100000", None, 422, "limit"),
    ("limit-text", "GET", "/v1/deployments?limit=abc", None, 422, "limit"),
    ("offset-negative", "GET", "/v1/deployments?offset=-1", None, 422, "offset"),
    ("offset-huge", "GET", "/v1/events?offset=100000000000000000000", None, 422, "offset"),
    ("since-huge", "GET", "/v1/events?since=1e20", None, 422, "since"),
    ("since-garbage", "GET", "/v1/audit?since=yesterday", None, 422, "since"),
    ("cluster-status-filter", "GET", "/v1/clusters?status=broken", None, 422, "status"),
    ("pool-tier-filter", "GET", "/v1/pools?tier=cheap", None, 422, "tier"),
    # clusters and pools
    ("cluster-id-dot", "POST", "/v1/clusters", {"id": "a.b"}, 422, "id"),
    # the wire's cluster id rule: an id its agent could never heart-beat under is refused
    ("cluster-id-upper", "POST", "/v1/clusters", {"id": "Edge1"}, 422, "id"),
    ("cluster-id-underscore", "POST", "/v1/clusters", {"id": "edge_1"}, 422, "id"),
    ("cluster-id-missing", "POST", "/v1/clusters", {"region": "eu"}, 422, "id"),
    ("cluster-lat", "POST", "/v1/clusters", {"id": "c1", "lat": 91}, 422, "lat"),
    ("cluster-lon", "POST", "/v1/clusters", {"id": "c1", "lon": -181}, 422, "lon"),
    ("cluster-url", "POST", "/v1/clusters", {"id": "c1", "gateway_url": "ftp://x"}, 422, "gateway_url"),
    ("cluster-unhealthy", "POST", "/v1/clusters", {"id": "c1", "status": "unhealthy"}, 422, "status"),
    (
        "cluster-pool-tier",
        "POST",
        "/v1/clusters",
        {"id": "c1", "pools": [{"name": "p", "gpu_model": "L4", "tier": "cheap"}]},
        422,
        "pools.0.tier",
    ),
    (
        "cluster-pool-dup",
        "POST",
        "/v1/clusters",
        {"id": "c1", "pools": [{"name": "p", "gpu_model": "L4"}, {"name": "p", "gpu_model": "H100"}]},
        422,
        "pools",
    ),
    ("cluster-taken", "POST", "/v1/clusters", {"id": CLUSTER}, 409, "id"),
    ("cluster-patch-status", "PATCH", f"/v1/clusters/{CLUSTER}", {"status": "unhealthy"}, 422, "status"),
    ("cluster-patch-unknown", "PATCH", "/v1/clusters/nope", {"status": "draining"}, 404, None),
    ("cluster-patch-extra", "PATCH", f"/v1/clusters/{CLUSTER}", {"id": "renamed"}, 422, "id"),
    ("cluster-delete-unknown", "DELETE", "/v1/clusters/nope", None, 404, None),
    (
        "pool-nodes",
        "POST",
        f"/v1/clusters/{CLUSTER}/pools",
        {"name": "p", "gpu_model": "L4", "nodes": -1},
        422,
        "nodes",
    ),
    (
        "pool-gpus-per-node",
        "POST",
        f"/v1/clusters/{CLUSTER}/pools",
        {"name": "p", "gpu_model": "L4", "gpus_per_node": 0},
        422,
        "gpus_per_node",
    ),
    (
        "pool-price",
        "POST",
        f"/v1/clusters/{CLUSTER}/pools",
        {"name": "p", "gpu_model": "L4", "hourly_price": -1},
        422,
        "hourly_price",
    ),
    ("pool-missing-gpu", "POST", f"/v1/clusters/{CLUSTER}/pools", {"name": "p"}, 422, "gpu_model"),
    ("pool-taken", "POST", f"/v1/clusters/{CLUSTER}/pools", {"name": "gpus", "gpu_model": "L4"}, 409, "name"),
    ("pool-delete-unknown", "DELETE", f"/v1/clusters/{CLUSTER}/pools/nope", None, 404, None),
    # keys
    ("key-missing-name", "POST", "/v1/keys", {}, 422, "name"),
    ("key-control-char", "POST", "/v1/keys", {"name": "a\u0000b"}, 422, "name"),
    ("key-scope-unknown", "POST", "/v1/keys", {"name": "k", "scopes": ["root"]}, 422, "scopes.0"),
    ("key-scopes-empty", "POST", "/v1/keys", {"name": "k", "scopes": []}, 422, "scopes"),
    ("key-scopes-dup", "POST", "/v1/keys", {"name": "k", "scopes": ["read", "read"]}, 422, "scopes"),
    ("key-team-space", "POST", "/v1/keys", {"name": "k", "team": "ml infra"}, 422, "team"),
    ("key-team-empty", "POST", "/v1/keys", {"name": "k", "team": ""}, 422, "team"),
    ("key-team-number", "POST", "/v1/keys", {"name": "k", "team": 7}, 422, "team"),
    (
        "key-quota-zero",
        "POST",
        "/v1/keys",
        {"name": "k", "quotas": {"tokens_per_minute": 0}},
        422,
        "quotas.tokens_per_minute",
    ),
    (
        "key-quota-priority",
        "POST",
        "/v1/keys",
        {"name": "k", "quotas": {"priority": 11}},
        422,
        "quotas.priority",
    ),
    ("key-quota-unknown", "POST", "/v1/keys", {"name": "k", "quotas": {"burst": 5}}, 422, "quotas.burst"),
    (
        "key-deployment-name",
        "POST",
        "/v1/keys",
        {"name": "k", "deployments": ["Bad Name"]},
        422,
        "deployments.0",
    ),
    ("key-revoke-unknown", "DELETE", "/v1/keys/nope", None, 404, None),
    # hostile: nesting a parser would recurse into, a duration past year 1
    (
        "deeply-nested",
        "POST",
        "/v1/deployments",
        '{"name": "x", "model": ' + "[" * 5000 + "]" * 5000 + "}",
        400,
        None,
    ),
    (
        "nested-patch",
        "PATCH",
        f"/v1/deployments/{TARGET}",
        '{"engine_args": ' + '{"a": ' * 200 + "1" + "}" * 201,
        400,
        None,
    ),
    ("surrogate-name", "POST", "/v1/deployments", '{"name": "\\ud800", "model": "m"}', 400, None),
    ("since-999999999999d", "GET", "/v1/usage?since=999999999999d", None, 422, "since"),
    # routing
    ("no-route", "GET", "/v1/nothing-here", None, 404, None),
    ("wrong-method", "PUT", "/v1/deployments", {}, 405, None),
]


@pytest.fixture(scope="module")
def seeded(cp_server):
    with cp_server.client() as admin:
        assert (
            admin.post(
                "/v1/deployments", json={"name": TARGET, "model": "m", "min_replicas": 1, "max_replicas": 3}
            ).status_code
            == 201
        )
        assert (
            admin.post(
                "/v1/clusters", json={"id": CLUSTER, "pools": [{"name": "gpus", "gpu_model": "L4"}]}
            ).status_code
            == 201
        )
    return cp_server


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_refused_with_reason(seeded, admin, method, path, body, status, field):
    if isinstance(body, str):
        res = admin.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        res = admin.request(method, path, json=body) if body is not None else admin.request(method, path)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert error["message"] and error["type"]
    if field is not None:
        assert error["field"] == field or error["field"].startswith(field + "."), error
        if status == 422:
            assert field.split(".")[0] in error["message"], error


def test_bad_input_changed_nothing(seeded, admin):
    dep = admin.get(f"/v1/deployments/{TARGET}").json()
    assert (dep["current_version"], dep["desired_replicas"], dep["min_replicas"], dep["max_replicas"]) == (
        1,
        1,
        1,
        3,
    )
    assert admin.get("/v1/deployments/fresh").status_code == 404
    assert admin.get("/v1/clusters/c1").status_code == 404
    assert admin.get("/v1/healthz").status_code == 404


def test_oversized_body_is_413(seeded, admin):
    big = json.dumps(dep(model="m", engine_args={"x": "y" * 4000})) + " " * (1 << 20)
    res = admin.post("/v1/deployments", content=big, headers={"content-type": "application/json"})
    assert res.status_code == 413 and "bytes" in res.json()["error"]["message"]


def test_not_json_content_type_is_422(seeded, admin):
    res = admin.post(
        "/v1/deployments",
        content=b"name=x&model=m",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert res.status_code == 422, res.text


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Basic YWRtaW46YWRtaW4=",
        "Bearer",
        "Bearer garbage",
        "Bearer fleet-000000000000-nope",
        "Bearer " + "x" * 5000,
    ],
    ids=["none", "basic", "empty-bearer", "garbage", "unknown-key", "huge"],
)
def test_unauthenticated_is_401(seeded, header):
    import httpx

    headers = {"Authorization": header} if header else {}
    for method, path in (
        ("GET", "/v1/deployments"),
        ("POST", "/v1/keys"),
        ("DELETE", f"/v1/deployments/{TARGET}"),
    ):
        res = httpx.request(method, seeded.url + path, headers=headers, json={} if method == "POST" else None)
        assert res.status_code == 401, (method, path, res.text)
        assert res.headers["www-authenticate"] == "Bearer"
        assert res.json()["error"]["type"] == "unauthorized"
    assert httpx.get(seeded.url + "/healthz").status_code == 200


def test_wrong_secret_and_revoked_key_are_401_read_scope_write_is_403(seeded, admin):
    created = admin.post("/v1/keys", json={"name": "ro", "scopes": ["read"]}).json()
    key, key_id = created["key"], created["key_id"]
    with seeded.client(key[:-4] + "AAAA") as forged:
        assert forged.get("/v1/deployments").status_code == 401
    with seeded.client(key) as reader:
        assert reader.get(f"/v1/deployments/{TARGET}").status_code == 200
        for method, path, body in (
            ("POST", "/v1/deployments", dep(name="by-reader")),
            ("POST", f"/v1/deployments/{TARGET}/scale", {"replicas": 2}),
            ("PATCH", f"/v1/clusters/{CLUSTER}", {"status": "draining"}),
            ("DELETE", f"/v1/deployments/{TARGET}", None),
            ("POST", "/v1/keys", {"name": "escalate", "scopes": ["admin"]}),
        ):
            res = reader.request(method, path, json=body)
            assert res.status_code == 403, (method, path, res.text)
            assert "scope" in res.json()["error"]["message"]
        assert admin.delete(f"/v1/keys/{key_id}").status_code == 200
        assert reader.get("/v1/deployments").status_code == 401
    assert admin.get(f"/v1/deployments/{TARGET}").json()["desired_replicas"] == 1


def test_concurrent_patches_are_never_a_500(seeded, admin):
    """Eight PATCHes of one deployment at once, each a new spec: each is applied (one after
    another) or told to retry with a 409; the versions stay consecutive and unique."""
    from concurrent.futures import ThreadPoolExecutor

    name = "raced"
    assert admin.post("/v1/deployments", json={"name": name, "model": "m"}).status_code == 201

    def patch(i: int) -> int:
        with seeded.client() as c:
            return c.patch(f"/v1/deployments/{name}", json={"engine_args": {"i": i}}).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(patch, range(8)))
    assert set(statuses) <= {200, 409}, statuses
    assert 200 in statuses
    versions = [v["version"] for v in admin.get(f"/v1/deployments/{name}/versions").json()["items"]]
    assert sorted(versions) == list(range(1, len(versions) + 1))
    assert len(versions) == 1 + statuses.count(200)
