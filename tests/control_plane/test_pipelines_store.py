"""Pipelines as stored and read back (`control_plane.pipelines`): the one reader the
placer, the routing table and the API use."""

from __future__ import annotations

from control_plane.db.models import Deployment, Pipeline
from control_plane.pipelines import load_pipelines, missing_deployments, pipelines_using, row_of
from fleet_base.pipelines import PipelineSpec, PipelineStep


def _spec(name: str, *steps: tuple[str, str], slo: float | None = None) -> PipelineSpec:
    return PipelineSpec(
        name=name, steps=tuple(PipelineStep(name=s, deployment=d) for s, d in steps), slo_e2e_s=slo
    )


def test_round_trip_in_name_order_and_step_order(sessions):
    rag = _spec("rag", ("embed", "emb"), ("answer", "chat"), slo=0.8)
    voice = _spec("asr", ("vad", "vad"), ("transcribe", "whisper"), ("answer", "chat"))
    with sessions() as s:
        s.add_all([row_of(rag), row_of(voice)])
        s.commit()
    with sessions() as s:
        assert load_pipelines(s) == [voice, rag]
        assert pipelines_using(s, "chat") == ["asr", "rag"]
        assert pipelines_using(s, "emb") == ["rag"]
        assert pipelines_using(s, "other") == []


def test_a_row_that_no_longer_validates_is_left_out(sessions):
    with sessions() as s:
        s.add(
            Pipeline(name="bad", steps=[{"name": "a", "deployment": "x"}, {"name": "a", "deployment": "y"}])
        )
        s.add(row_of(_spec("good", ("a", "x"))))
        s.commit()
    with sessions() as s:
        assert [p.name for p in load_pipelines(s)] == ["good"]


def test_missing_deployments_in_step_order(sessions):
    with sessions() as s:
        s.add(Deployment(name="chat"))
        s.commit()
        spec = _spec("rag", ("embed", "emb"), ("rerank", "rr"), ("answer", "chat"))
        assert missing_deployments(s, spec) == ["emb", "rr"]
        assert missing_deployments(s, _spec("one", ("answer", "chat"))) == []
