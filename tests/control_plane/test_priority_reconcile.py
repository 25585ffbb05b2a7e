"""Priorities through the live path on a real database: the autoscaler's scale-up of a
critical deployment on a full fleet is an ordinary replica count that reconcile hands
to the placer (the MILP, the default, and FFD alike), which preempts a batch deployment's
replicas, records `preempted` events with the reason, and never takes from equal or
higher classes."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.loops.autoscale import AutoscaleLoop
from control_plane.loops.reconcile import reconcile_once
from control_plane.placement import get_placer
from control_plane.settings import Settings
from fleet_base.protocol import Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus


@pytest.fixture
def sessions(sessions):
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", load={}, last_heartbeat_at=m.utcnow())
        c.pools = [m.CapacityPool(name="sim", gpu_model="sim", gpus_per_node=1, nodes=4, hourly_price=1.0)]
        train = m.Deployment(name="train", replicas=3, current_version=1, priority="batch")
        train.versions = [m.DeploymentVersion(version=1, model="tiny", min_replicas=3, max_replicas=3)]
        chat = m.Deployment(name="chat", replicas=1, current_version=1, priority="critical")
        chat.versions = [
            m.DeploymentVersion(version=1, model="tiny", min_replicas=1, max_replicas=3, target_concurrency=2)
        ]
        s.add_all([c, train, chat])
        s.commit()
    return sessions


def _placed(sessions) -> dict[str, int]:
    with sessions() as s:
        rows = s.scalars(select(m.ReplicaAssignment)).all()
        out: dict[str, int] = {}
        for a in rows:
            out[a.deployment.name] = out.get(a.deployment.name, 0) + 1
        return out


@pytest.mark.parametrize("placer", ["milp", "ffd"])
def test_autoscaled_critical_scale_up_preempts_batch_through_reconcile(sessions, tmp_path, placer):
    p = get_placer(placer)
    memory: tuple[dict, dict] = ({}, {})
    reconcile_once(sessions, p, *memory)
    assert _placed(sessions) == {"train": 3, "chat": 1}  # the fleet is full

    loop = AutoscaleLoop(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions))
    busy = ReplicaLoad(running=12, requests_per_s=6.0, tokens_per_s=300, ttft_s=0.2)
    with sessions() as s:
        chat_replica = s.scalar(
            select(m.ReplicaAssignment).join(m.Deployment).where(m.Deployment.name == "chat")
        )
        rid = chat_replica.replica_id
    now = time.time()
    for i in range(40):  # 80 s of heartbeats from one overloaded chat replica
        t = now + 2 * i
        loop.heartbeats["c1"] = Heartbeat(cluster="c1", sent_at=t, replicas=[
            ReplicaStatus(replica_id=rid, deployment="chat", version=1, state=ReplicaState.ready, load=busy)])  # fmt: skip
        loop.tick(t)
    with sessions() as s:
        assert s.scalar(select(m.Deployment.replicas).where(m.Deployment.name == "chat")) == 3

    outcome = reconcile_once(sessions, p, *memory)
    assert _placed(sessions) == {"train": 1, "chat": 3}
    if placer == "milp":  # the model's own plan, not its greedy fallback
        assert outcome.info is not None and outcome.info.method.startswith("milp"), outcome.info
    with sessions() as s:
        events = s.scalars(select(m.Event).where(m.Event.kind == "preempted")).all()
        shorts = s.scalars(select(m.Event).where(m.Event.kind == "placement_short")).all()
    assert len(events) == 2 and all(e.deployment == "train" for e in events)
    assert all("(batch) preempted on c1/sim to place chat v1 (critical)" in e.message for e in events)
    assert any("preempted by chat (critical)" in e.message for e in shorts if e.deployment == "train")

    # The batch deployment scaling up again takes nothing back from the critical one.
    with sessions() as s:
        train = s.scalar(select(m.Deployment).where(m.Deployment.name == "train"))
        train.versions[0].min_replicas, train.versions[0].max_replicas = 1, 4
        train.replicas = 4
        s.commit()
    reconcile_once(sessions, p, *memory)
    assert _placed(sessions) == {"train": 1, "chat": 3}
