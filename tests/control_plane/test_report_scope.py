"""A compromised cluster's reports speak only for itself: usage only for keys that exist
and deployments placed on the sender, dated in a plausible window; heartbeats only about
the sender's own replicas; demand bounded; and one bad report never aborts the autoscale
tick for the other deployments."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from sqlalchemy import func, select

from control_plane.context import ControlPlaneContext
from control_plane.counters import Rejections
from control_plane.db import models as m
from control_plane.loops.autoscale import AutoscaleLoop
from control_plane.loops.durable import Received
from control_plane.loops.usage import prune_records, store_usage_batch
from control_plane.rollouts.loop import RolloutLoop
from control_plane.settings import Settings
from fleet_base import protocol
from fleet_base.protocol import Demand, Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus
from fleet_base.wire import Rejected, decode_demand, decode_usage

NOW = time.time()


def _fleet(sessions, autoscaled: tuple[str, ...] = ("chat", "code")) -> None:
    """Clusters east and west; deployments placed on east only (one ready replica each);
    one API key."""
    with sessions() as s:
        s.add_all([m.Cluster(id="east", region="r1", load={}), m.Cluster(id="west", region="r2", load={})])
        s.add(m.ApiKey(key_id="k1", name="k1", salt="s", hash="h"))
        for name in autoscaled:
            d = m.Deployment(name=name, replicas=1, current_version=1)
            d.versions = [m.DeploymentVersion(version=1, model="m", min_replicas=1, max_replicas=8,
                                              autoscale_window_s=1.0, target_concurrency=2.0)]  # fmt: skip
            s.add(d)
            s.flush()
            s.add(m.ReplicaAssignment(replica_id=f"{name}-e1", deployment_id=d.id, version=1,
                                      cluster_id="east", state="ready"))  # fmt: skip
        s.commit()


def _usage(cluster: str, **fields) -> Received:
    record = protocol.UsageRecord(cluster=cluster, **{"key_id": "k1", "deployment": "chat", **fields})
    return Received(protocol.usage_subject(cluster), record.to_bytes(), 0)


def _stored(sessions) -> list[tuple[str, str, str]]:
    with sessions() as s:
        return [(r.cluster, r.key_id, r.deployment) for r in s.scalars(select(m.UsageRecord))]


def _replicas(sessions, name: str) -> int:
    with sessions() as s:
        return s.scalar(select(m.Deployment.replicas).where(m.Deployment.name == name))


def _loop(sessions, tmp_path) -> AutoscaleLoop:
    return AutoscaleLoop(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions))


# --------------------------------------------------------------------- demand and the autoscale tick


def test_a_huge_demand_is_refused_on_the_wire() -> None:
    subject = protocol.demand_subject("west")
    huge = b'{"cluster": "west", "deployment": "chat", "queued": 1' + b"0" * 400 + b"}"
    with pytest.raises(Rejected):
        decode_demand(subject, huge)
    ok = decode_demand(subject, Demand(cluster="west", deployment="chat", queued=5).to_bytes())
    assert ok.queued == 5


def test_one_bad_report_does_not_abort_the_tick_for_other_deployments(sessions, tmp_path) -> None:
    _fleet(sessions)
    loop = _loop(sessions, tmp_path)
    # what got past the wire before: an int too large for a float in the queued sum
    loop.demands[("west", "chat")] = Demand.model_construct(
        cluster="west", deployment="chat", queued=10**400, ready=1, at=NOW, schema_version=1
    )
    loop.demands[("east", "code")] = Demand(cluster="east", deployment="code", queued=40, ready=1, at=NOW)
    for i in range(4):
        loop.tick(NOW + i)  # no OverflowError escapes
    assert _replicas(sessions, "code") > 1  # the other deployment was decided
    assert _replicas(sessions, "chat") <= 8  # the claim is bounded: at most max_replicas


def test_a_deployment_whose_decision_fails_is_counted_and_skipped(sessions, tmp_path, monkeypatch) -> None:
    _fleet(sessions)
    loop = _loop(sessions, tmp_path)
    decide = loop.policy.decide

    def failing(settings, state, obs):
        if obs.queued > 1000:
            raise OverflowError("int too large to convert to float")
        return decide(settings, state, obs)

    monkeypatch.setattr(loop.policy, "decide", failing)
    loop.demands[("west", "chat")] = Demand(cluster="west", deployment="chat", queued=5000, ready=1, at=NOW)
    loop.demands[("east", "code")] = Demand(cluster="east", deployment="code", queued=40, ready=1, at=NOW)
    for i in range(4):
        loop.tick(NOW + i)
    assert _replicas(sessions, "code") > 1 and _replicas(sessions, "chat") == 1
    assert loop.inbox.rejections.failure_snapshot()["autoscale"] == 4


def test_demand_entries_per_cluster_are_bounded(sessions, tmp_path) -> None:
    loop = _loop(sessions, tmp_path)
    for i in range(5000):
        loop._take_demand(Demand(cluster="west", deployment=f"d{i}", queued=1, ready=1))
    assert len(loop.demands) <= 1024
    assert loop.inbox.rejections.refusals[("demand", "budget")] > 0


# --------------------------------------------------------------------- heartbeats


def test_heartbeats_about_replicas_not_placed_on_the_sender_do_not_steer_the_autoscaler(
    sessions, tmp_path
) -> None:
    _fleet(sessions, autoscaled=("chat",))
    loop = _loop(sessions, tmp_path)
    busy = ReplicaLoad(running=500, waiting=500, requests_per_s=50.0)
    quiet = ReplicaLoad(running=1)
    for i in range(5):
        t = NOW + i
        # west claims ready replicas of chat (placed only on east) and east's own replica id
        loop.heartbeats["west"] = Heartbeat(cluster="west", sent_at=t, replicas=[
            ReplicaStatus(replica_id=f"w{j}", deployment="chat", version=1, state=ReplicaState.ready,
                          load=busy) for j in range(3)] + [
            ReplicaStatus(replica_id="chat-e1", deployment="chat", version=1, state=ReplicaState.ready,
                          load=busy)])  # fmt: skip
        loop.heartbeats["east"] = Heartbeat(cluster="east", sent_at=t, replicas=[
            ReplicaStatus(replica_id="chat-e1", deployment="chat", version=1, state=ReplicaState.ready,
                          load=quiet)])  # fmt: skip
        loop.tick(t)
    assert _replicas(sessions, "chat") == 1
    assert loop.inbox.rejections.refusals[("heartbeat", "not_placed")] >= 4


def test_a_heartbeat_dated_ahead_goes_stale_on_the_control_planes_clock(sessions, tmp_path) -> None:
    loop = _loop(sessions, tmp_path)
    loop._take_heartbeat(Heartbeat(cluster="east", sent_at=253_402_300_000.0))
    assert abs(loop.heartbeats["east"].sent_at - time.time()) < 60


# --------------------------------------------------------------------- usage


def test_usage_only_for_existing_keys_and_deployments_placed_on_the_sender(sessions) -> None:
    _fleet(sessions)
    rejections = Rejections()
    batch = [
        _usage("east", prompt_tokens=10, version=1),  # served here: stored
        _usage("west", prompt_tokens=10, version=1),  # chat is not placed on west
        _usage("east", key_id="nokey", prompt_tokens=10),  # no such key
        _usage("east", deployment="nodep", prompt_tokens=10),  # no such deployment
        _usage("west", status=429),  # a refusal, no tokens: any gateway may refuse
    ]
    store_usage_batch(sessions, batch, rejections)
    assert _stored(sessions) == [("east", "k1", "chat"), ("west", "k1", "chat")]
    assert rejections.refusals[("usage", "not_served")] == 2
    assert rejections.refusals[("usage", "unknown_key")] == 1


def test_usage_dated_in_the_future_or_beyond_retention_is_refused(sessions) -> None:
    _fleet(sessions)
    rejections = Rejections()
    batch = [
        _usage("east", prompt_tokens=1, at=NOW + 3600),  # an hour ahead
        _usage("east", prompt_tokens=1, at=253_402_300_000.0),  # year 9999: never pruned
        _usage("east", prompt_tokens=1, at=NOW - 400 * 86400),  # beyond the 90-day retention
        _usage("east", prompt_tokens=1, at=NOW + 5),  # clock skew within bounds
    ]
    store_usage_batch(sessions, batch, rejections)
    assert len(_stored(sessions)) == 1
    assert rejections.refusals[("usage", "future")] == 2
    assert rejections.refusals[("usage", "expired")] == 1


def test_where_a_served_request_ran_is_the_senders_registration_not_its_claim(sessions) -> None:
    """A cluster cannot make its usage look processed in another jurisdiction."""
    _fleet(sessions)
    with sessions() as s:
        s.get(m.Cluster, "east").jurisdiction = "ca"
        s.commit()
    batch = [
        _usage("east", prompt_tokens=3, version=1, region="r9", jurisdiction="us"),  # a false claim
        _usage("west", status=429, region="r2", jurisdiction="us"),  # a refusal: nothing ran
    ]
    store_usage_batch(sessions, batch, Rejections())
    with sessions() as s:
        rows = {(r.cluster, r.region, r.jurisdiction) for r in s.scalars(select(m.UsageRecord))}
    assert rows == {("east", "r1", "ca"), ("west", "r2", "us")}


def test_usage_tokens_per_record_are_bounded() -> None:
    """A record may claim one context window's worth of tokens, not 2^31."""
    record = _usage("east", prompt_tokens=1)
    with pytest.raises(Rejected):
        decode_usage(record.subject, record.data.replace(b'"prompt_tokens":1', b'"prompt_tokens":2000000000'))


def test_pruning_leaves_no_row_older_than_retention(sessions) -> None:
    _fleet(sessions)
    store_usage_batch(
        sessions, [_usage("east", prompt_tokens=1, at=NOW - d * 86400) for d in (1, 10, 50)], Rejections()
    )
    now = datetime.now(timezone.utc)
    assert prune_records(sessions, now - timedelta(days=20)) == 1
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(m.UsageRecord)) == 2


# --------------------------------------------------------------------- rollout samples


def _rollout_fleet(sessions) -> None:
    with sessions() as s:
        s.add_all([m.Cluster(id="c1", region="r1", load={}), m.Cluster(id="c2", region="r2", load={})])
        d = m.Deployment(name="web", replicas=2, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="a"), m.DeploymentVersion(version=2, model="b")]
        s.add(d)
        s.flush()
        s.add_all([
            m.ReplicaAssignment(replica_id="v1", deployment_id=d.id, version=1, cluster_id="c1", state="ready"),
            m.ReplicaAssignment(replica_id="v1b", deployment_id=d.id, version=1, cluster_id="c2", state="ready"),
            m.ReplicaAssignment(replica_id="v2", deployment_id=d.id, version=2, cluster_id="c1", state="ready"),
            m.Rollout(deployment_id=d.id, baseline_version=1, canary_version=2, phase="observing", step=0,
                      params={"steps": [50, 100], "min_requests": 5}, phase_started_at=NOW - 30,
                      window_started_at=NOW - 30, reason="", last={}, revision=0),
        ])  # fmt: skip
        s.commit()


class _Msg(SimpleNamespace):
    pass


def test_rollout_samples_from_a_cluster_not_hosting_the_version_are_ignored(sessions) -> None:
    _rollout_fleet(sessions)
    loop = RolloutLoop(SimpleNamespace(sessions=sessions, nats=None, kick=lambda: None))
    loop.started_at = NOW - 60

    def usage(cluster: str, version: int, status: int) -> _Msg:
        r = protocol.UsageRecord(cluster=cluster, key_id="k", deployment="web", version=version,
                                 status=status, latency_s=0.1)  # fmt: skip
        return _Msg(subject=protocol.usage_subject(cluster), data=r.to_bytes())

    async def feed() -> None:
        for _ in range(20):  # c2 hosts no canary: its errors about v2 would force a rollback
            await loop._on_usage(usage("c2", 2, 500))
        await loop._on_usage(usage("c1", 2, 200))
        await loop._on_usage(usage("c2", 1, 200))  # c2 hosts the baseline: counted

    loop.tick(time.time())  # reads what is placed where
    asyncio.run(feed())
    assert loop.windows.stats("web", 2, NOW - 60).requests == 1
    assert loop.windows.stats("web", 1, NOW - 60).requests == 1
    loop.tick(time.time())
    with sessions() as s:
        assert s.scalar(select(m.Rollout.phase)) != "rolled_back"
