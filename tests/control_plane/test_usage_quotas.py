"""The control plane's side of quotas: the share policy (hypothesis), usage records and
shares in the database (SQLite and PostgreSQL), PATCH /v1/keys, GET /v1/usage with the
estimated cost, and `fleetctl keys update` / `fleetctl usage` as a user runs them."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.db.models import ApiKey, CapacityPool, Cluster, Deployment, ReplicaAssignment
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.fleet_model.shares import ShareSettings, compute_shares
from control_plane.loops.usage import prune_records, store_records, update_shares
from fleet_base.protocol import UsageRecord as UsageMessage
from fleet_base.wire import usage_problem as record_problem
from tests.control_plane.cp_server import ControlPlaneServer
from tests.control_plane.test_fleetctl_resources import as_json, fleetctl, one_line_error

NAMES = st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=0, max_size=5, unique=True)


@settings(max_examples=300, deadline=None)
@given(
    clusters=NAMES,
    usage=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e", "x"]), st.floats(0, 1e6), max_size=6),
    min_share=st.floats(0, 0.5),
)
def test_shares_sum_to_at_most_one_with_a_floor(clusters, usage, min_share) -> None:
    s = ShareSettings(min_share=min_share, min_change=0)
    shares = compute_shares(usage, clusters, {}, s)
    if len(clusters) <= 1:
        assert shares == {}
        return
    assert set(shares) == set(clusters)
    assert sum(shares.values()) <= 1 + 1e-9
    assert sum(shares.values()) >= 1 - 1e-3 * len(clusters)  # only rounding is lost
    floor = min(min_share, 1 / len(clusters))
    assert all(v >= floor - 1e-4 for v in shares.values())
    for a in clusters:  # more demand, no smaller share
        for b in clusters:
            if usage.get(a, 0) > usage.get(b, 0):
                assert shares[a] >= shares[b]


def test_shares_hysteresis_and_no_news() -> None:
    s = ShareSettings(min_share=0.1, min_change=0.05)
    prev = {"a": 0.5, "b": 0.5}
    assert compute_shares({}, ["a", "b"], prev, s) == prev  # nothing used: keep the split
    assert compute_shares({"a": 51, "b": 49}, ["a", "b"], prev, s) == prev  # too small a move
    moved = compute_shares({"a": 90, "b": 10}, ["a", "b"], prev, s)
    assert moved == {"a": 0.82, "b": 0.18}
    assert compute_shares({"a": 1}, ["a", "b", "c"], prev, s) == {"a": 0.8, "b": 0.1, "c": 0.1}


def test_record_problems() -> None:
    ok = UsageMessage(cluster="east", key_id="k1", deployment="chat", prompt_tokens=3)
    assert record_problem(ok) is None
    assert "key_id" in record_problem(ok.model_copy(update={"key_id": "k" * 40}))
    assert "prompt_tokens" in record_problem(ok.model_copy(update={"prompt_tokens": -1}))


def test_usage_moves_the_shares_in_the_database(db_url: str) -> None:
    upgrade_to_head(db_url)
    sessions = make_sessions(db_url)
    with sessions() as session:
        session.add_all(
            [
                Cluster(id="east", region="east"),
                Cluster(id="west", region="west"),
                Cluster(id="gone", region="x", status="unhealthy"),
                ApiKey(key_id="lim", name="lim", salt="s", hash="h", quotas={"tokens_per_minute": 1000}),
                ApiKey(key_id="free", name="free", salt="s", hash="h", quotas={}),
            ]
        )
        session.commit()
    now = datetime.now(timezone.utc)
    old = (now - timedelta(minutes=5)).timestamp()
    store_records(
        sessions,
        [
            UsageMessage(
                cluster="east", key_id="lim", deployment="d", prompt_tokens=600, completion_tokens=300
            ),
            UsageMessage(cluster="west", key_id="lim", deployment="d", prompt_tokens=100),
            UsageMessage(
                cluster="west", key_id="lim", deployment="d", prompt_tokens=10_000, at=old
            ),  # too old
            UsageMessage(cluster="east", key_id="free", deployment="d", prompt_tokens=5),
        ],
    )
    settings_ = ShareSettings(window_s=60, min_share=0.1)
    assert update_shares(sessions, settings_, now) == ["lim"]
    with sessions() as session:
        lim, free = session.get(ApiKey, "lim"), session.get(ApiKey, "free")
        assert lim.shares == {"east": 0.82, "west": 0.18}  # 0.1 + 0.8 * 900/1000; the unhealthy one none
        assert free.shares == {}
    # refusals count as demand too: west wanted 9,000 more
    assert update_shares(sessions, settings_, now, {"lim": {"west": 9000}}) == ["lim"]
    with sessions() as session:
        assert session.get(ApiKey, "lim").shares == {"east": 0.172, "west": 0.828}
    assert update_shares(sessions, settings_, now, {"lim": {"west": 9000}}) == []  # stable
    assert prune_records(sessions, now - timedelta(minutes=1)) == 1  # the 5-minute-old one


@pytest.mark.slow  # a server process and three fleetctl subprocesses
def test_patch_keys_and_usage_report(sqlite_server: ControlPlaneServer) -> None:
    with sqlite_server.client() as api:
        r = api.post(
            "/v1/keys",
            json={
                "name": "team",
                "quotas": {
                    "tokens_per_minute": 2000,
                    "tokens_per_day": 100_000,
                    "priority_class": "batch",
                    "deployments": {"chat": {"requests_per_minute": 5}},
                },
            },
        )
        assert r.status_code == 201, r.text
        key_id = r.json()["key_id"]
        assert r.json()["quotas"]["deployments"]["chat"]["requests_per_minute"] == 5
        r = api.patch(
            f"/v1/keys/{key_id}", json={"quotas": {"tokens_per_minute": 3000, "tokens_per_day": None}}
        )
        assert r.status_code == 200, r.text
        quotas = r.json()["quotas"]
        assert quotas["tokens_per_minute"] == 3000 and quotas["tokens_per_day"] is None
        assert quotas["priority_class"] == "batch"  # untouched
        bad = api.patch(f"/v1/keys/{key_id}", json={"quotas": {"tokens_per_minute": 0}})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "quotas.tokens_per_minute"
        bad = api.patch(f"/v1/keys/{key_id}", json={"quotas": {"priority_class": "Not Valid"}})
        assert bad.status_code == 422 and "priority_class" in bad.json()["error"]["message"]
        assert api.patch("/v1/keys/nope", json={"name": "x"}).status_code == 404
        audit = api.get("/v1/audit", params={"resource_id": key_id, "action": "key.update"}).json()["items"]
        assert audit and audit[0]["after"]["quotas"]["tokens_per_minute"] == 3000

    sessions = make_sessions(sqlite_server.database_url)
    with sessions() as session:
        dep = Deployment(name="chat", replicas=1)
        session.add_all([dep, Cluster(id="east", region="east")])
        session.flush()
        session.add(
            CapacityPool(cluster_id="east", name="gpu", gpu_model="h100", gpus_per_node=8, hourly_price=16.0)
        )
        session.add(
            ReplicaAssignment(
                replica_id="r1", deployment_id=dep.id, version=1, cluster_id="east", pool_name="gpu", gpus=2
            )
        )
        session.commit()
    store_records(
        sessions,
        [
            UsageMessage(
                cluster="east", key_id=key_id, deployment="chat", prompt_tokens=300, completion_tokens=100
            ),
            UsageMessage(cluster="east", key_id="other", deployment="chat", prompt_tokens=100, status=500),
            UsageMessage(cluster="east", key_id=key_id, deployment="embed", prompt_tokens=7),
            UsageMessage(
                cluster="east",
                key_id=key_id,
                deployment="chat",
                prompt_tokens=999,
                at=(datetime.now(timezone.utc) - timedelta(hours=3)).timestamp(),
            ),
        ],
    )
    with sqlite_server.client() as api:
        report = api.get("/v1/usage", params={"since": "1h"}).json()
        rows = {(i["key_id"], i["deployment"]): i for i in report["items"]}
        assert set(rows) == {(key_id, "chat"), ("other", "chat"), (key_id, "embed")}
        mine = rows[(key_id, "chat")]
        assert (mine["requests"], mine["prompt_tokens"], mine["completion_tokens"], mine["total_tokens"]) == (
            1,
            300,
            100,
            400,
        )
        assert rows[("other", "chat")]["errors"] == 1
        # chat costs 16/8 * 2 = 4 an hour; over ~1 h, 400 of its 500 tokens are this key's
        assert mine["estimated_cost"] == pytest.approx(4 * 0.8, rel=0.01)
        assert rows[(key_id, "embed")]["estimated_cost"] == 0  # nothing placed
        assert report["total_tokens"] == 507
        only = api.get("/v1/usage", params={"key": key_id, "deployment": "chat", "since": "1d"}).json()
        assert [i["total_tokens"] for i in only["items"]] == [1399]
        bad = api.get("/v1/usage", params={"since": "yesterday"})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "since"

    home = sqlite_server.home
    updated = as_json(
        home, "keys", "update", key_id, "--requests-per-minute", "60", "--priority-class", "interactive"
    )
    assert (
        updated["quotas"]["requests_per_minute"] == 60
        and updated["quotas"]["priority_class"] == "interactive"
    )
    cleared = as_json(
        home, "keys", "update", key_id, "--clear", "requests_per_minute", "--deployment-limit", "chat:tpm=500"
    )
    assert cleared["quotas"]["requests_per_minute"] is None
    assert cleared["quotas"]["deployments"]["chat"]["tokens_per_minute"] == 500
    assert "deployment-limit" in one_line_error(
        fleetctl(home, "keys", "update", key_id, "--deployment-limit", "chat:xyz=1", ok=False)
    )
    usage = as_json(home, "usage", "--key", key_id, "--since", "2h")
    assert {i["deployment"] for i in usage["items"]} == {"chat", "embed"}
    table = fleetctl(home, "usage", "--deployment", "chat").stdout
    assert "est. cost" in table and key_id in table and "total: 500 tokens" in table
