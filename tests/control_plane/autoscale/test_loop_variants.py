"""The autoscale loop's tick on a real database: the SLO policy's decision (count and
cheapest GPU mix) lands on the deployment, and the placement inputs follow the mix."""

from __future__ import annotations

import time

from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.fleet_model.plan import placement_inputs
from control_plane.fleet_model.snapshot import read_snapshot
from control_plane.loops.autoscale import AutoscaleLoop
from control_plane.settings import Settings
from fleet_base.protocol import Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus


def test_tick_writes_the_count_and_the_cheapest_gpu_mix(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    upgrade_to_head(url)
    sessions = make_sessions(url)
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", load={})
        c.pools = [  # A100s at a third of the H100s' price: the cheaper way to carry this load
            m.CapacityPool(name="h", gpu_model="H100", gpus_per_node=8, nodes=4, hourly_price=8 * 9.0),
            m.CapacityPool(name="a", gpu_model="A100", gpus_per_node=8, nodes=4, hourly_price=8 * 3.0),
        ]
        d = m.Deployment(name="chat", replicas=1, current_version=1)
        d.versions = [
            m.DeploymentVersion(
                version=1, model="llama2-70b", gpu_count=4, min_replicas=1, max_replicas=8,
                engine_args={"profile": "llama2-70b-h100-tp4", "profile_A100": "llama2-70b-a100-tp4"},
            )
        ]  # fmt: skip
        s.add_all([c, d])
        s.flush()  # the replica the heartbeats report is one placed on c1 (others are not counted)
        s.add(
            m.ReplicaAssignment(
                replica_id="r1", deployment_id=d.id, version=1, cluster_id="c1", state="ready"
            )
        )
        s.commit()
    loop = AutoscaleLoop(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions))
    now = time.time()
    busy = ReplicaLoad(
        running=30, requests_per_s=8.0, prompt_tokens_per_s=12000, tokens_per_s=1600, ttft_s=0.2
    )
    for i in range(40):  # 80 s of heartbeats from one busy replica
        t = now + 2 * i
        loop.heartbeats["c1"] = Heartbeat(cluster="c1", sent_at=t, replicas=[
            ReplicaStatus(replica_id="r1", deployment="chat", version=1, state=ReplicaState.ready, load=busy)])  # fmt: skip
        loop.tick(t)
    with sessions() as s:
        dep = s.scalar(select(m.Deployment).where(m.Deployment.name == "chat"))
        assert dep.replicas > 1 and dep.variant_mix == {"A100": dep.replicas}
        events = s.scalars(select(m.Event).where(m.Event.kind == "scaled")).all()
        assert events and '"mix"' in events[-1].message and "prompt" in events[-1].message
        snap = read_snapshot(s)
    demands, _, _ = placement_inputs(snap)
    assert demands[0].gpu_models == ("A100",) and demands[0].count == dep.replicas
    # the forecasts made a cold start before the last ticks were checked against their load
    checked = loop.errors.get("chat")
    assert checked is not None and checked.last["requests_per_s"].observed == 8.0
    assert checked.last["prompt_tokens_per_s"].observed == 12000
    sessions.kw["bind"].dispose()
