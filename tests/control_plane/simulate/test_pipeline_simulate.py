"""`fleetctl simulate` on a pipeline trace: every step its own deployment, the next step
called a hop after the previous finished; per-step and end-to-end latency, the pipeline-aware
run against each step alone and the fixed fleet at their peaks."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bench.pipeline_trace import pipeline_rows, write_jsonl
from control_plane.cli import app
from control_plane.simulate import default_settings
from control_plane.simulate.pipeline import (
    PipelineSimulation,
    StepSetup,
    compare_pipeline,
    trace_pipeline_name,
)
from control_plane.simulate.trace import TraceError, is_pipeline_trace, load_pipeline_trace
from fleet_base.pipelines import PipelineSpec, PipelineStep
from fleet_base.profile import load_profile


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pl") / "rag.jsonl"
    write_jsonl(pipeline_rows(240, seed=3, shape="dense"), path)
    return path


def _steps(names) -> list[StepSetup]:
    prof = load_profile("llama2-70b-h100-tp4")
    return [StepSetup(n, prof, default_settings(prof).model_copy(update={"max_replicas": 8})) for n in names]


def test_each_request_walks_the_steps_in_order(trace_file) -> None:
    names, trace = load_pipeline_trace(trace_file)
    assert names == ("embed", "answer") and is_pipeline_trace(trace_file)
    spec = PipelineSpec(
        name="rag", steps=tuple(PipelineStep(name=n, deployment=n) for n in names), slo_e2e_s=10
    )
    hop = 0.25
    sim = PipelineSimulation(trace, spec, _steps(names), "ours", budget_aware=True, hop_s=hop)
    run = sim.run()
    assert run.unfinished == 0 and len(run.e2e) == run.requests == len(trace)
    assert all(len(run.step_latency[n]) == len(trace) for n in names)
    # end to end is both steps plus the hop, for every request (same order: by arrival)
    assert min(run.e2e) >= hop + min(run.step_latency["embed"]) + min(run.step_latency["answer"]) - 1e-9
    assert sum(run.e2e) == pytest.approx(sum(run.step_latency["embed"]) + sum(run.step_latency["answer"])
                                         + hop * len(trace), rel=1e-6)  # fmt: skip


def test_one_table_three_runs(trace_file) -> None:
    names, trace = load_pipeline_trace(trace_file)
    report = compare_pipeline(trace, _steps(names), 10.0, pipeline="rag", warmup_s=30)
    assert [r.label for r in report.rows] == ["pipeline-aware", "steps alone", "fixed at peak"]
    for r in report.rows:
        assert r.completed == r.requests > 0
        assert set(r.steps) == {"embed", "answer"}
        assert r.e2e_p90_s >= r.steps["answer"].p50_s
        assert r.budget_met == (r.e2e_p90_s <= 10.0)
    assert report.rows[1].budget_ticks == 0  # each step alone never sees the budget
    fixed = report.rows[2]
    assert all(s.replicas_max == s.replicas_mean for s in fixed.steps.values())


def test_cli_pipeline_trace(trace_file) -> None:
    out = CliRunner().invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace_file),
            "--slo-e2e",
            "10s",
            "--policies",
            "ours",
            "--output",
            "json",
        ],
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["slo_e2e_s"] == 10 and report["hop_s"] == pytest.approx(0.01) and len(report["rows"]) == 3
    missing = CliRunner().invoke(app, ["simulate", "--trace", str(trace_file)])
    assert missing.exit_code != 0 and "--slo-e2e" in missing.output


def test_steps_must_match(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"at": 0, "steps": [{"step": "a", "prompt_tokens": 1, "output_tokens": 1}]}\n'
        '{"at": 1, "steps": [{"step": "b", "prompt_tokens": 1, "output_tokens": 1}]}\n'
    )
    with pytest.raises(TraceError, match="first line"):
        load_pipeline_trace(path)


def _line(at, *steps: str) -> str:
    return json.dumps(
        {"at": at, "steps": [{"step": s, "prompt_tokens": 8, "output_tokens": 4} for s in steps]}
    )


@pytest.mark.parametrize(
    ("file", "lines", "budget", "said"),
    [
        ("lower.jsonl", [_line(0, "Embed", "answer")], "20s", "steps.0.name: String should match pattern"),
        ("lower.jsonl", [_line(0, "embed_1", "answer")], "20s", "'embed_1'"),
        ("lower.jsonl", [_line(0, "a", "a")], "20s", "step names repeat: a, a"),
        ("lower.jsonl", [_line(0, *(f"s{i}" for i in range(17)))], "20s", "at most 16"),
        (
            "lower.jsonl",
            [_line(0, "embed", "answer")],
            "2h",
            "slo_e2e_s: Input should be less than or equal to 3600",
        ),
        ("nan.jsonl", ['{"at": NaN, "steps": []}'], "20s", "nan.jsonl:1: a pipeline request needs at"),
        (
            "inf.jsonl",
            [
                _line(0, "a"),
                '{"at": Infinity, "steps": [{"step": "a", "prompt_tokens": 1, "output_tokens": 1}]}',
            ],
            "20s",
            "inf.jsonl:2:",
        ),
        ("str.jsonl", [_line(0, "a"), _line("nan", "a")], "20s", "str.jsonl:2:"),
    ],
)
def test_cli_bad_pipeline_trace_is_one_clear_line(tmp_path, file, lines, budget, said) -> None:
    path = tmp_path / file
    path.write_text("\n".join(lines) + "\n")
    out = CliRunner().invoke(
        app, ["simulate", "--trace", str(path), "--slo-e2e", budget, "--policies", "ours"]
    )
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output  # no traceback
    assert "error:" in out.output and said in " ".join(out.output.split()), out.output
    if "jsonl:" in said:
        assert "finite" in out.output


@pytest.mark.parametrize(
    ("stem", "name"), [("rag_trace", "rag-trace"), ("RAG", "rag"), ("__", "trace"), ("a" * 80, "a" * 63)]
)
def test_trace_file_names_become_pipeline_names(tmp_path, stem, name) -> None:
    assert trace_pipeline_name(stem) == name
    path = tmp_path / f"{stem}.jsonl"
    write_jsonl(pipeline_rows(20, seed=1, shape="dense"), path)
    out = CliRunner().invoke(
        app, ["simulate", "--trace", str(path), "--slo-e2e", "20s", "--policies", "ours", "--output", "json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["pipeline"] == name
