"""Routing tables name the pipelines their deployment is a step of (and only those), and a
table from a newer writer still decodes: unknown pipeline fields dropped, a pipeline this
reader cannot parse left out, the route kept."""

from __future__ import annotations

import json

from control_plane.fleet_model.plan import build_routes
from control_plane.fleet_model.snapshot import DeploymentRow, FleetSnapshot, VersionSpec
from control_plane.loops.reconcile import reconcile_once
from control_plane.pipelines import row_of
from control_plane.placement import get_placer
from fleet_base.pipelines import PipelineSpec, PipelineStep
from fleet_base.protocol import BUCKET_ROUTES, RoutingTable
from tests.control_plane.test_loops import add_deployment


def _spec(name: str, *steps: tuple[str, str]) -> PipelineSpec:
    return PipelineSpec(name=name, steps=tuple(PipelineStep(name=s, deployment=d) for s, d in steps))


RAG = _spec("rag", ("embed", "emb"), ("answer", "chat"))
VOICE = _spec("voice", ("listen", "asr"), ("answer", "chat"))


def _snap() -> FleetSnapshot:
    names = ("emb", "chat", "asr", "other")
    return FleetSnapshot(
        deployments=tuple(DeploymentRow(name=n, replicas=1, current_version=1) for n in names),
        specs={(n, 1): VersionSpec(deployment=n, version=1, model="m") for n in names},
    )


def test_each_table_names_the_pipelines_of_its_deployment_only() -> None:
    routes = build_routes(_snap(), [], pipelines=[RAG, VOICE])
    assert routes["chat"].pipelines == [RAG, VOICE]
    assert routes["emb"].pipelines == [RAG] and routes["asr"].pipelines == [VOICE]
    assert routes["other"].pipelines == []
    assert build_routes(_snap(), [])["chat"].pipelines == []  # none defined


def test_a_newer_writers_pipelines_decode_tolerantly() -> None:
    wire = json.loads(RoutingTable(deployment="chat", pipelines=[RAG, VOICE]).to_bytes())
    wire["pipelines"][0]["owner"] = "team-a"  # a field this reader does not know
    wire["pipelines"][0]["steps"][0]["timeout_s"] = 3
    wire["pipelines"][1]["steps"] = "not steps"  # unreadable: left out, the route kept
    table = RoutingTable.model_validate_json(json.dumps(wire))
    assert table.pipelines == [RAG] and table.deployment == "chat"
    assert RoutingTable.model_validate_json('{"deployment": "chat"}').pipelines == []


def test_the_reconcile_pass_publishes_each_deployments_pipelines(sessions) -> None:
    for name in ("emb", "chat", "other"):
        add_deployment(sessions, name)
    with sessions() as s:
        s.add(row_of(RAG))
        s.commit()
    routes = reconcile_once(sessions, get_placer("ffd"), {}, {}).wanted[BUCKET_ROUTES]
    assert routes["emb"].pipelines == [RAG] and routes["chat"].pipelines == [RAG]  # type: ignore[attr-defined]
    assert routes["other"].pipelines == []  # type: ignore[attr-defined]
