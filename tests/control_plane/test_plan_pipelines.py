"""`fleetctl plan` with a pipeline whose steps need different GPU types: a feasible
co-placement where one cluster has both, a clear reason where none has."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from control_plane.cli import app

HEADER = "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region,AvailabilityZone\n"
BOTH_IN_EAST = HEADER + (
    "g-l4,L4,1,1.0,,us-east1,us-east1-b\n"
    "a3-h100,H100,1,10.0,,us-east1,us-east1-b\n"
    "g-l4w,L4,1,0.5,,us-west1,us-west1-b\n"
)
SPLIT_ONLY = HEADER + ("g-l4,L4,1,1.0,,us-east1,us-east1-b\na3-h100,H100,1,10.0,,us-west1,us-west1-b\n")
DEMANDS = {
    "deployments": [
        {"name": "emb", "replicas": 2, "gpu_models": ["L4"]},
        {"name": "chat", "replicas": 1, "gpu_models": ["H100"]},
    ]
}


def _plan(tmp_path, catalog: str, demands: dict, *extra: str):
    (tmp_path / "cat.csv").write_text(catalog)
    (tmp_path / "demands.json").write_text(json.dumps(demands))
    args = ["plan", "--catalog", str(tmp_path / "cat.csv"), "--demands", str(tmp_path / "demands.json")]
    return CliRunner().invoke(app, [*args, "--capacity", "4", "--tier", "on-demand", *extra])


def _clusters(report: dict, deployment: str) -> set[str]:
    return set(report["replicas_by_region"].get(deployment, {}))


def test_plan_co_places_steps_of_different_gpu_types(tmp_path):
    free = json.loads(_plan(tmp_path, BOTH_IN_EAST, DEMANDS, "-o", "json").output)
    assert _clusters(free, "emb") == {"us-west1"} and free["pipeline_cost"] is None  # cheaper apart
    res = _plan(tmp_path, BOTH_IN_EAST, DEMANDS, "--pipeline", "rag=embed:emb,answer:chat", "-o", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert _clusters(report, "emb") == _clusters(report, "chat") == {"us-east1"}
    assert report["unplaced"] == [] and report["violations"] == []
    (line,) = report["pipeline_cost"]["pipelines"]
    assert (
        line["feasible"]
        and len(line["clusters"]) == 1
        and line["steps"] == {"embed": ["L4"], "answer": ["H100"]}
    )
    cost = report["pipeline_cost"]
    assert (
        cost["together"]["cost_per_hour"] - cost["apart"]["cost_per_hour"] == 1.0
    )  # two L4s at 1.0, not 0.5
    # the same pipeline from demands.json, as a table
    table = _plan(tmp_path, BOTH_IN_EAST, {**DEMANDS, "pipelines": [{"name": "rag", "steps": [
        {"name": "embed", "deployment": "emb"}, {"name": "answer", "deployment": "chat"}]}]})  # fmt: skip
    assert table.exit_code == 0, table.output
    assert "pipelines (every step in each cluster listed)" in table.output
    assert "co-placing pipelines: +1.00 $/hour" in table.output


def test_plan_says_why_no_cluster_can_host_the_pipeline(tmp_path):
    res = _plan(tmp_path, SPLIT_ONLY, DEMANDS, "--pipeline", "rag=embed:emb,answer:chat", "-o", "json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["replicas"] == 0
    (line,) = report["pipeline_cost"]["pipelines"]
    assert not line["feasible"] and line["clusters"] == []
    assert "pipeline rag: no cluster can host every step" in line["reason"]
    assert "step answer (deployment chat)" in line["reason"] and "H100" in line["reason"]
    assert report["pipeline_cost"]["apart"]["unplaced"] == 0  # placed apart it would fit: a split
    table = _plan(tmp_path, SPLIT_ONLY, DEMANDS, "--pipeline", "rag=embed:emb,answer:chat")
    assert table.exit_code == 0 and "no cluster can host every step" in table.output.replace("\n", " ")


def test_plan_refuses_a_bad_pipeline(tmp_path):
    res = _plan(tmp_path, BOTH_IN_EAST, DEMANDS, "--pipeline", "rag=embed:emb,answer:nope")
    assert res.exit_code == 1 and "no deployment nope" in res.output
    res = _plan(tmp_path, BOTH_IN_EAST, DEMANDS, "--pipeline", "rag")
    assert res.exit_code == 1 and "NAME=STEP:DEPLOYMENT" in res.output
