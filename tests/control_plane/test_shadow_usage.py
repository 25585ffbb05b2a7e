"""Shadow copies as the control plane publishes and counts them: the route of a deployment
in a shadow phase names the copy target with no user weight; a copy's usage record is
stored as shadow usage and left out of every consumer of a key's usage (quota shares, the
usage report and its cost, regional demand, the console's version series)."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from control_plane.api.metrics import _shadow_metrics
from control_plane.api.routers.usage import get_usage
from control_plane.console.series import usage_rows
from control_plane.db import models as m
from control_plane.fleet_model.demand_regions import read_demand_regions
from control_plane.fleet_model.plan import build_routes
from control_plane.fleet_model.shares import ShareSettings
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.loops.usage import store_records, update_shares
from control_plane.rollouts.shadow import Finished, compare
from fleet_base.protocol import ShadowTarget, UsageRecord, VersionWeight


def _fleet(sessions, window_started_at: float | None):
    with sessions() as s:
        s.add(
            m.Cluster(
                id="east",
                region="east",
                gateway_url="http://east:9000",
                last_heartbeat_at=m.utcnow(),
                load={},
            )
        )
        s.add(
            m.Cluster(
                id="west",
                region="west",
                gateway_url="http://west:9000",
                last_heartbeat_at=m.utcnow(),
                load={},
            )
        )
        s.add(m.ApiKey(key_id="lim", name="lim", salt="s", hash="h", quotas={"tokens_per_minute": 1000}))
        d = m.Deployment(name="chat", replicas=10, current_version=1)
        d.versions = [
            m.DeploymentVersion(version=1, model="tiny"),
            m.DeploymentVersion(version=2, model="tiny-b"),
        ]
        s.add(d)
        s.flush()
        for i in range(10):
            s.add(
                m.ReplicaAssignment(
                    replica_id=f"b{i}", deployment_id=d.id, version=1, cluster_id="east", state="ready"
                )
            )
        s.add(
            m.ReplicaAssignment(
                replica_id="c0", deployment_id=d.id, version=2, cluster_id="west", state="ready"
            )
        )
        s.add(
            m.Rollout(
                deployment_id=d.id, baseline_version=1, canary_version=2, phase="shadowing", step=0,
                params={"steps": [10.0, 100.0], "shadow_share": 0.1, "shadow_duration_s": 60.0},
                phase_started_at=time.time(), window_started_at=window_started_at, shadow_share=0.1,
                shadow_duration_s=60.0, shadow_phase="running",
            )
        )  # fmt: skip
        s.commit()
        return read_snapshot(s)


def test_a_shadow_phase_routes_copies_and_no_users_to_the_new_version(sessions):
    snap = _fleet(sessions, window_started_at=time.time())
    table = build_routes(snap, list(snap.assignments))["chat"]
    assert table.shadow == ShadowTarget(version=2, share=0.1)
    assert table.versions == [VersionWeight(version=2, weight=0.0), VersionWeight(version=1, weight=1.0)]


def test_no_copies_before_the_new_versions_replicas_are_ready(sessions):
    snap = _fleet(sessions, window_started_at=None)
    assert build_routes(snap, list(snap.assignments))["chat"].shadow is None


def test_copies_are_shadow_usage_never_the_keys(sessions):
    _fleet(sessions, window_started_at=time.time())
    original = UsageRecord(
        cluster="east", key_id="lim", deployment="chat", version=1, prompt_tokens=600, itl_s=0.01
    )
    copy = UsageRecord(
        cluster="west", key_id="lim", deployment="chat", version=2, prompt_tokens=600, completion_tokens=5000,
        shadow=True, shadow_of=original.record_id, itl_s=0.02, greedy_match=False, first_diff_token=3,
    )  # fmt: skip
    assert store_records(sessions, [original, copy]) == 2
    with sessions() as s:
        stored = s.query(m.UsageRecord).filter_by(record_id=copy.record_id).one()
        assert (stored.shadow, stored.shadow_of, stored.itl_s, stored.greedy_match, stored.first_diff_token) == (
            True, original.record_id, 0.02, False, 3,
        )  # fmt: skip
    now = datetime.now(timezone.utc)
    assert update_shares(sessions, ShareSettings(window_s=60, min_share=0.1), now) == ["lim"]
    with sessions() as s:
        assert s.get(m.ApiKey, "lim").shares == {"east": 0.9, "west": 0.1}  # the copy's west tokens: none
        snap = read_snapshot(s)
        assert read_demand_regions(s, snap) == {"chat": {"east": 1.0}}
        assert [r.version for r in usage_rows(s, "chat", time.time() - 60)] == [1]
        report = get_usage(
            session=s, who=None, key=None, deployment=None, since="1h", region=None, jurisdiction=None
        )
    assert [(i.key_id, i.total_tokens) for i in report.items] == [("lim", 600)]
    assert report.total_tokens == 600
    assert [(r.deployment, r.version, r.requests, r.completion_tokens) for r in report.shadow] == [
        ("chat", 2, 1, 5000)
    ]


def test_metrics_carry_the_latest_shadow_comparison(sessions):
    _fleet(sessions, window_started_at=time.time())
    stats = compare(
        [Finished("o1", False, 0.1, 0.01), Finished("o2", False, 0.1, 0.01)],
        [Finished("c1", False, 0.2, 0.02, "o1", True), Finished("c2", True, 0.3, 0.02, "o2", False, 5)],
        share=1.0,
    ).as_json()
    with sessions() as s:
        s.query(m.Rollout).update({"shadow_stats": stats})
        s.commit()
        families = {f.name: f for f in _shadow_metrics(s)}
    samples = {(f, tuple(x.labels.values())): x.value for f, fam in families.items() for x in fam.samples}
    assert samples[("fleet_control_plane_shadow_agreement", ("chat",))] == 0.5
    assert samples[("fleet_control_plane_shadow_errors", ("chat", "copy"))] == 1
    assert samples[("fleet_control_plane_shadow_latency_seconds", ("chat", "ttft", "p90", "copy"))] == 0.3
    assert samples[("fleet_control_plane_shadow_running", ("chat",))] == 1
