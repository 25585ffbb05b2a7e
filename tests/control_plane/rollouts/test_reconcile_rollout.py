"""A rollout through the real database, reconcile and rollout tick (no NATS, no clock):
two live versions placed with replica counts per version, routes weighted canary first,
the baseline shrinking only as canary replicas become ready, promotion making the
canary current, a breach rolling back, and every transition an event with numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import select, update

from control_plane.db import models as m
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from control_plane.rollouts.loop import RolloutLoop
from control_plane.rollouts.policy import RolloutParams
from control_plane.rollouts.telemetry import UsageWindows
from fleet_base.protocol import UsageRecord
from tests.control_plane.rollouts.helpers import assignments_by

STEPS = (25.0, 50.0, 100.0)


@pytest.fixture
def sessions(sessions):
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", gateway_url="http://c1:9000", load={})
        c.pools = [m.CapacityPool(name="main", gpu_model="cpu", gpus_per_node=6, nodes=1)]
        d = m.Deployment(name="web", replicas=4, current_version=1)
        d.versions = [m.DeploymentVersion(version=1, model="a"), m.DeploymentVersion(version=2, model="b")]
        s.add_all([c, d])
        s.flush()
        s.add(
            m.Rollout(
                deployment_id=d.id, baseline_version=1, canary_version=2, phase="deploying", step=0,
                params=RolloutParams(steps=STEPS, step_duration_s=10, min_requests=10, max_error_rate=0.1).model_dump(mode="json"),
                phase_started_at=0.0, reason="", last={}, revision=0,
            )
        )  # fmt: skip
        s.commit()
    return sessions


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reconcile(sessions):
    return reconcile_once(sessions, get_placer("ffd"), {}, {})


def per_version(sessions) -> dict[int, int]:
    return assignments_by(sessions, "version")


def make_ready(sessions) -> None:
    with sessions() as s:
        s.execute(update(m.ReplicaAssignment).values(state="ready"))
        s.commit()


def weights(outcome) -> list[tuple[int, float]]:
    return [(v.version, v.weight) for v in outcome.wanted["fleet_routes"]["web"].versions]


def feed(windows: UsageWindows, version: int, n: int, errors: int = 0) -> None:
    for i in range(n):
        windows.add(
            UsageRecord(
                cluster="c1",
                key_id="k",
                deployment="web",
                version=version,
                status=500 if i < errors else 200,
                latency_s=0.1,
            )
        )


def kinds(sessions) -> list[str]:
    with sessions() as s:
        return [
            e.kind
            for e in s.scalars(select(m.Event).where(m.Event.kind.like("rollout%")).order_by(m.Event.id))
        ]


def test_capacity_follows_weights_through_promotion(sessions):
    clock = Clock()
    windows = UsageWindows(clock=clock)
    loop = RolloutLoop(SimpleNamespace(sessions=sessions), windows=windows)
    loop.started_at = 0.0
    peak = 0

    def step(now: float) -> None:
        nonlocal peak
        clock.now = now
        loop.tick(now)
        out = reconcile(sessions)
        peak = max(peak, sum(per_version(sessions).values()))
        return out

    out = step(1)
    assert per_version(sessions) == {1: 4, 2: 1}  # canary asked for, baseline untouched until it is ready
    assert weights(out) == [(2, 0.0), (1, 1.0)]
    make_ready(sessions)
    out = step(2)  # canary ready: step 1 opens, the baseline gives one replica back
    assert per_version(sessions) == {1: 3, 2: 1}
    assert weights(out) == [(2, 0.25), (1, 0.75)]
    feed(windows, 2, 12)
    feed(windows, 1, 30)
    step(13)  # step 1 passed -> deploying step 2 (2 canary replicas)
    assert per_version(sessions) == {1: 3, 2: 2}
    make_ready(sessions)
    step(14)
    step(15)
    assert per_version(sessions) == {1: 2, 2: 2}
    feed(windows, 2, 12)
    step(26)
    make_ready(sessions)
    step(27)
    out = step(28)
    assert per_version(sessions) == {2: 4} and weights(out) == [(2, 1.0), (1, 0.0)]
    feed(windows, 2, 12)
    out = step(40)
    with sessions() as s:
        d = s.scalar(select(m.Deployment))
        ro = s.scalar(select(m.Rollout))
        assert d.current_version == 2 and ro.phase == "promoted" and ro.finished_at is not None
    assert weights(out) == [(2, 1.0)]
    assert peak <= 4 + 2  # never more than the baseline plus one step's canary replicas
    assert (
        kinds(sessions).count("rollout_step") == 5
    )  # 3 steps opened, 2 advances and kinds(sessions)[-1] == "rollout_promoted"


def test_a_bad_canary_is_rolled_back_and_its_replicas_removed(sessions):
    clock = Clock()
    windows = UsageWindows(clock=clock)
    loop = RolloutLoop(SimpleNamespace(sessions=sessions), windows=windows)
    loop.started_at = 0.0
    clock.now = 1
    loop.tick(1)
    reconcile(sessions)
    make_ready(sessions)
    loop.tick(2)
    reconcile(sessions)
    clock.now = 3
    feed(windows, 2, 4, errors=2)  # 2 errors > 10% of min_requests 10: already certain
    assert loop.tick(3) is True
    out = reconcile(sessions)
    assert per_version(sessions) == {1: 4}
    assert [(v.version, v.weight) for v in out.wanted["fleet_routes"]["web"].versions] == [(1, 1.0)]
    with sessions() as s:
        ro = s.scalar(select(m.Rollout))
        assert ro.phase == "rolled_back" and "error rate" in ro.reason
        assert ro.last["canary_errors"] == 2 and ro.last["canary_requests"] == 4
        assert s.scalar(select(m.Deployment)).current_version == 1
        message = s.scalar(select(m.Event).where(m.Event.kind == "rollout_rolled_back")).message
    assert "canary_error_rate=0.5" in message


def test_a_stale_revision_does_not_overwrite_an_operator(sessions):
    """The loop read the row, an operator aborted it meanwhile: the loop's write is dropped."""
    from control_plane.rollouts.store import state_of, write_state

    with sessions() as s:
        row = s.scalar(select(m.Rollout))
        stale = m.Rollout(id=row.id, revision=row.revision, deployment_id=row.deployment_id, canary_version=2)
        assert write_state(s, row, state_of(row).model_copy(update={"phase": "aborted"}))
        s.commit()
    with sessions() as s:
        assert not write_state(s, stale, state_of(row).model_copy(update={"phase": "observing"}))
        s.commit()
        assert s.scalar(select(m.Rollout)).phase == "aborted"
