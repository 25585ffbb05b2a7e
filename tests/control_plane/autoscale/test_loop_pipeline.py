"""The autoscale loop with a pipeline's end-to-end budget on a real database: the step over
its share is decided against a tighter TTFT target (more replicas, the reason says why),
the step within its share as on its own; a share below what the step reaches with the least
load buys nothing, so that step is decided on its own targets and the reason says so."""

from __future__ import annotations

import time

from sqlalchemy import select

from control_plane.context import ControlPlaneContext
from control_plane.db import models as m
from control_plane.db.session import make_sessions, upgrade_to_head
from control_plane.loops.autoscale import AutoscaleLoop
from control_plane.pipelines import row_of
from control_plane.settings import Settings
from fleet_base.pipelines import PipelineSpec, PipelineStep
from fleet_base.protocol import Heartbeat, ReplicaLoad, ReplicaState, ReplicaStatus


def _run(tmp_path, slo_e2e_s: float | None) -> tuple[dict[str, int], AutoscaleLoop]:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    upgrade_to_head(url)
    sessions = make_sessions(url)
    with sessions() as s:
        c = m.Cluster(id="c1", region="r1", status="healthy", load={})
        c.pools = [m.CapacityPool(name="h", gpu_model="H100", gpus_per_node=8, nodes=8, hourly_price=72.0)]
        s.add(c)
        for name in ("emb", "chat"):
            d = m.Deployment(name=name, replicas=1, current_version=1)
            d.versions = [
                m.DeploymentVersion(version=1, model="llama2-70b", gpu_count=4, min_replicas=1, max_replicas=16,
                                    engine_args={"profile": "llama2-70b-h100-tp4"})
            ]  # fmt: skip
            s.add(d)
            s.flush()
            s.add(m.ReplicaAssignment(replica_id=f"{name}-r1", deployment_id=d.id, version=1,
                                      cluster_id="c1", state="ready"))  # fmt: skip
        steps = (PipelineStep(name="embed", deployment="emb"), PipelineStep(name="answer", deployment="chat"))
        s.add(row_of(PipelineSpec(name="rag", steps=steps, slo_e2e_s=slo_e2e_s)))
        s.commit()
    loop = AutoscaleLoop(ControlPlaneContext(settings=Settings(home=tmp_path), sessions=sessions))
    now = time.time()
    emb = ReplicaLoad(running=2, requests_per_s=4.0, prompt_tokens_per_s=2000, tokens_per_s=4, ttft_s=0.01)
    chat = ReplicaLoad(running=6, requests_per_s=4.0, prompt_tokens_per_s=6000, tokens_per_s=800, ttft_s=1.5)
    for i in range(40):
        t = now + 2 * i
        loop.heartbeats["c1"] = Heartbeat(cluster="c1", sent_at=t, replicas=[
            ReplicaStatus(replica_id="emb-r1", deployment="emb", version=1, state=ReplicaState.ready, load=emb),
            ReplicaStatus(replica_id="chat-r1", deployment="chat", version=1, state=ReplicaState.ready, load=chat),
        ])  # fmt: skip
        loop.tick(t)
    with sessions() as s:
        counts = {d.name: d.replicas for d in s.scalars(select(m.Deployment))}
    sessions.kw["bind"].dispose()
    return counts, loop


def test_step_over_its_share_scales_first(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone, free = _run(tmp_path / "a", None)
    budgeted, loop = _run(tmp_path / "b", 0.4)
    assert free.budgets == {}
    assert loop.budgets["chat"].over and loop.budgets["chat"].priority == 1
    assert not loop.budgets["emb"].over
    assert budgeted["chat"] > alone["chat"]
    assert budgeted["emb"] == alone["emb"]
    assert "pipeline rag" in loop.last["chat"].reason and "budget" in loop.last["chat"].reason
    assert "pipeline rag" not in loop.last["emb"].reason
    assert loop.last["chat"].predicted["pipeline"]["over"] is True


def test_step_whose_share_no_count_reaches_keeps_its_own_target(tmp_path) -> None:
    """150 ms for the pipeline: chat's share (~130 ms) is below its 1500-token prompt's own
    prefill on an empty queue, so no replica count meets it; chat is scaled as on its own."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    alone, _ = _run(tmp_path / "a", None)
    budgeted, loop = _run(tmp_path / "b", 0.15)
    chat = loop.budgets["chat"]
    assert chat.over and chat.unreachable and chat.priority == 0
    assert chat.settings_update() == {}
    assert budgeted == alone
    assert "unreachable by scaling" in loop.last["chat"].reason
    assert loop.last["chat"].predicted["pipeline"]["unreachable"] is True
