"""The rollout loop drives a shadow phase on the database: the window opens once the
canary's first-step replicas are ready, the comparison is stored each tick, and at the end
of the phase the verdict is written with its event (no NATS: records are fed directly)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from sqlalchemy import select

from control_plane.db import models as m
from control_plane.rollouts.loop import RolloutLoop
from fleet_base.protocol import UsageRecord


def _fleet(sessions, agreement_floor: float) -> None:
    with sessions() as s:
        d = m.Deployment(name="web", replicas=10, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="a"), m.DeploymentVersion(version=2, model="b")]
        s.add_all([d, m.Cluster(id="c1", load={})])
        s.flush()
        s.add(
            m.ReplicaAssignment(
                replica_id="b1", deployment_id=d.id, version=1, cluster_id="c1", state="ready"
            )
        )
        s.add(
            m.ReplicaAssignment(
                replica_id="c1", deployment_id=d.id, version=2, cluster_id="c1", state="ready"
            )
        )
        params = {"steps": [10.0, 100.0], "shadow_share": 0.5, "shadow_duration_s": 5.0, "shadow_min_requests": 4,
                  "shadow_min_greedy_agreement": agreement_floor}  # fmt: skip
        s.add(
            m.Rollout(
                deployment_id=d.id, baseline_version=1, canary_version=2, phase="shadowing", step=0, params=params,
                phase_started_at=time.time(), shadow_share=0.5, shadow_duration_s=5.0, shadow_phase="running",
            )
        )  # fmt: skip
        s.commit()


def _feed(loop: RolloutLoop, at: float, identical: int, differing: int) -> None:
    for i in range(identical + differing):
        original = UsageRecord(cluster="c1", key_id="k", deployment="web", version=1, ttft_s=0.1, itl_s=0.01)
        loop.windows.add(original, at=at)
        copy = UsageRecord(
            cluster="c1", key_id="k", deployment="web", version=2, ttft_s=0.1, itl_s=0.01, shadow=True,
            shadow_of=original.record_id, greedy_match=i < identical, first_diff_token=None if i < identical else 9,
        )  # fmt: skip
        loop.windows.add(copy, at=at)


def _row(sessions) -> m.Rollout:
    with sessions() as s:
        return s.scalars(select(m.Rollout)).one()


def _kinds(sessions) -> list[str]:
    with sessions() as s:
        return [e.kind for e in s.scalars(select(m.Event).order_by(m.Event.id))]


def test_a_shadow_phase_that_agrees_goes_on_to_the_canary_steps(sessions):
    _fleet(sessions, agreement_floor=0.5)
    loop = RolloutLoop(SimpleNamespace(sessions=sessions, nats=None, kick=lambda: None))
    t0 = loop.started_at + 1
    loop.tick(t0)
    row = _row(sessions)
    assert (row.phase, row.window_started_at, row.shadow_phase) == ("shadowing", t0, "running")
    _feed(loop, t0 + 1, identical=4, differing=1)
    loop.tick(t0 + 2)
    stats = _row(sessions).shadow_stats
    assert (stats["compared"], stats["greedy"]["identical"], stats["greedy"]["agreement"]) == (5, 4, 0.8)
    assert loop.windows.stats("web", 2, t0).requests == 0  # copies are no canary requests
    loop.tick(t0 + 6)
    row = _row(sessions)
    assert (row.phase, row.step, row.window_started_at, row.shadow_phase) == ("deploying", 0, None, "passed")
    assert "greedy agreement 0.800 on 5" in row.shadow_reason
    assert _kinds(sessions) == ["rollout_shadow", "rollout_shadow"]


def test_a_shadow_phase_that_disagrees_stops_the_rollout(sessions):
    _fleet(sessions, agreement_floor=0.9)
    loop = RolloutLoop(SimpleNamespace(sessions=sessions, nats=None, kick=lambda: None))
    t0 = loop.started_at + 1
    loop.tick(t0)
    _feed(loop, t0 + 1, identical=2, differing=3)
    loop.tick(t0 + 6)
    row = _row(sessions)
    assert (row.phase, row.shadow_phase) == ("rolled_back", "stopped")
    assert row.reason.startswith("stopped in the shadow phase: shadow greedy agreement 2/5 = 0.400 below 0.9")
    assert row.shadow_stats["greedy"]["first_diff_token_p50"] == 9
    assert _kinds(sessions)[-1] == "rollout_rolled_back"
