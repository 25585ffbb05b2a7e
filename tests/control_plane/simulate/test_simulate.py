"""The trace-driven simulator: trace readers, the discrete-event run on synthetic traces
(where the answer is known), and `fleetctl simulate` on the real Azure and Mooncake traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control_plane.autoscale import AutoscaleSettings
from control_plane.cli import app
from control_plane.simulate import compare, load_trace
from control_plane.simulate.des import Simulation
from control_plane.simulate.trace import TraceError, TraceRequest
from fleet_base.profile import PerfProfile

PROFILE = PerfProfile(
    name="t",
    gpus_per_replica=2,
    hourly_price=10.0,
    prefill_tokens=[100.0, 1000.0],
    prefill_s=[0.01, 0.1],
    decode_batch=[1.0, 8.0],
    decode_step_s=[0.01, 0.02],
    kv_capacity_tokens=100_000,
    max_num_seqs=8,
    cold_start_s=20.0,
)


def steady(
    rate: float, seconds: float, start: float = 0.0, prompt: int = 200, out: int = 50
) -> list[TraceRequest]:
    n = int(rate * seconds)
    return [TraceRequest(start + i / rate, prompt, out) for i in range(n)]


def test_trace_readers(tmp_path: Path, shared_data: Path) -> None:
    azure = load_trace(shared_data / "azure2023_conv.csv")
    assert len(azure) == 19366 and azure[0].at == 0 and 3400 < azure[-1].at < 3600
    fast = load_trace(shared_data / "azure2023_conv.csv", rate_scale=2, limit_s=60)
    assert fast[-1].at <= 60 and len(fast) > 2 * len([r for r in azure if r.at <= 60]) * 0.9
    moon = load_trace(shared_data / "mooncake_synthetic_trace.jsonl")
    assert len(moon) == 3993 and moon[0].prompt_tokens > 0
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,abc,3\n")
    with pytest.raises(TraceError, match=r"bad\.csv:2"):
        load_trace(bad)
    # Formats by content, not by file name (the Azure code trace shares the CSV columns).
    named = tmp_path / "AzureLLMInferenceTrace_code.trace"
    named.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,2048,8\n2023-11-16 18:15:47.6,1900,30\n"
    )
    assert [(r.at, r.prompt_tokens, r.output_tokens) for r in load_trace(named)] == [
        (0.0, 2048, 8),
        (1.5, 1900, 30),
    ]
    offsets = tmp_path / "week.csv"  # a byte-order mark, UTC offsets on the timestamps
    offsets.write_text(
        "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.250000+00:00,100,5\n2024-05-10 00:00:02+00:00,200,6\n"
    )
    assert [r.at for r in load_trace(offsets)] == [0.0, 1.75]
    moon_txt = tmp_path / "moon.txt"
    moon_txt.write_text(
        '{"timestamp": 0, "input_length": 9, "output_length": 2}\n{"timestamp": 500, "input_length": 5, "output_length": 1}\n'
    )
    assert [(r.at, r.prompt_tokens) for r in load_trace(moon_txt)] == [(0.0, 9), (0.5, 5)]
    (tmp_path / "cols.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="needs columns"):
        load_trace(tmp_path / "cols.csv")


def test_static_run_serves_everything_and_counts_gpu_time() -> None:
    trace = steady(2.0, 600)
    s = AutoscaleSettings(min_replicas=2, max_replicas=2, target_concurrency=4)
    run = Simulation(trace, PROFILE, s, "static", initial_replicas=2).run()
    assert all(r.finished_at is not None for r in run.requests)
    assert run.cold_starts == 0
    assert run.replica_seconds == pytest.approx(2 * run.end, rel=0.01)
    ttft = sorted(r.first_token_at - r.arrival for r in run.requests)
    assert ttft[len(ttft) // 2] < 0.05  # idle replicas: TTFT is the prefill


def test_autoscaler_follows_a_step_and_scales_to_zero_and_back() -> None:
    # 60 s quiet, 300 s busy, 300 s nothing, then one late request.
    trace = steady(0.5, 60) + steady(6.0, 300, start=60) + [TraceRequest(700.0, 100, 10)]
    s = AutoscaleSettings(min_replicas=0, max_replicas=10, target_concurrency=4)
    run = Simulation(trace, PROFILE, s, "ours", initial_replicas=1).run()
    assert all(r.finished_at is not None for r in run.requests)
    reps = {int(x.at): x.replicas for x in run.samples}
    assert max(v for t, v in reps.items() if 100 < t < 360) >= 2  # scaled up under load
    busy = [r for r in run.requests if 120 < r.arrival < 360]
    assert sum(r.first_token_at - r.arrival <= s.slo_ttft_s for r in busy) >= 0.99 * len(busy)
    assert min(v for t, v in reps.items() if 600 < t < 700) == 0  # to zero when idle
    late = run.requests[-1]
    assert late.first_token_at - late.arrival >= PROFILE.cold_start_s  # waited for a cold start
    assert any("scale from zero" in reason for _, _, reason in run.decisions)


def test_compare_static_gets_the_autoscaled_peak(tmp_path: Path) -> None:
    trace = steady(1.0, 200) + steady(6.0, 200, start=200) + steady(1.0, 200, start=400)
    s = AutoscaleSettings(min_replicas=1, max_replicas=10, target_concurrency=4)
    rep = compare(trace, PROFILE, s, slo_ttft_s=1.0, warmup_s=0, plot_path=tmp_path / "p.png")
    by = {p.policy: p for p in rep.policies}
    assert by["static"].replicas_max == by["static"].replicas_mean == by["ours"].replicas_max
    assert by["ours"].gpu_hours < by["static"].gpu_hours
    assert by["static"].gpu_hours == pytest.approx(by["static"].replica_hours * 2)
    assert by["static"].cost == pytest.approx(by["static"].replica_hours * 10, abs=0.02)
    assert (tmp_path / "p.png").stat().st_size > 10_000


def code_like(seconds: float, seed: int = 7) -> list[TraceRequest]:
    """`bench.code_like_trace`: long prompts (~2k tokens), short outputs (~25), a swing in
    the rate; a guard that the defaults hold on a workload unlike the conversation trace."""
    from bench.code_like_trace import generate

    return [TraceRequest(t, p, o) for t, p, o in generate(seconds, seed, period_s=1200)]


def test_long_prompts_short_outputs_hold_where_concurrency_collapses() -> None:
    from control_plane.simulate import default_settings
    from fleet_base.profile import load_profile

    prof = load_profile("llama2-70b-h100-tp4")
    rep = compare(
        code_like(900), prof, default_settings(prof), policies=("static", "kpa", "ours"), warmup_s=120
    )
    by = {p.policy: p for p in rep.policies}
    assert by["ours"].within_ttft_target >= 0.99
    assert by["ours"].gpu_hours < by["static"].gpu_hours
    assert by["kpa"].within_ttft_target < 0.95  # concurrency is the wrong signal here


def test_fleetctl_simulate_azure_hour(shared_data: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(shared_data / "azure2023_conv.csv"),
            "-o",
            "json",
            "--plot",
            str(tmp_path / "a.png"),
        ],
    )
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    assert (
        rep["requests"] == 19366 and rep["wall_s"] < 120
    )  # an hour of trace, four policies and the best-fixed search: ~15 s on an idle core
    by = {p["policy"]: p for p in rep["policies"]}
    assert set(by) == {"static", "kpa", "planner", "ours"}
    for p in by.values():
        assert p["completed"] == p["requests"] and 0 < p["ttft_p50_s"] <= p["ttft_p90_s"] <= p["ttft_p99_s"]
        assert 0 < p["itl_p50_s"] <= p["itl_p99_s"] and 0 < p["within_itl_target"] <= 1
    assert rep["slo_ttft_s"] == 2 and rep["slo_itl_s"] == 0.1  # the documented defaults
    assert by["ours"]["within_ttft_target"] >= 0.99
    # read against its bound: the cheapest fixed fleet that reaches the target (the rule)
    assert rep["best_fixed"] is not None and by["ours"]["reaches_target"] is True
    assert by["ours"]["gpu_hours_vs_best_fixed"] <= 1.25
    assert by["ours"]["gpu_hours"] < by["static"]["gpu_hours"]  # the static row is ours' peak
    assert by["ours"]["gpu_hours"] < by["kpa"]["gpu_hours"]
    assert by["ours"]["within_ttft_target"] >= by["kpa"]["within_ttft_target"]
    assert by["ours"]["within_itl_target"] >= by["kpa"]["within_itl_target"]
    assert by["ours"]["cold_starts"] < by["kpa"]["cold_starts"]


def test_fleetctl_simulate_mooncake_and_bad_input(shared_data: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    cfg = tmp_path / "dep.yaml"
    cfg.write_text(
        "autoscaling:\n  min_replicas: 1\n  max_replicas: 8\n  target_concurrency: 16\npolicies: [kpa, ours]\n"
    )
    out = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(shared_data / "mooncake_synthetic_trace.jsonl"),
            "--deployment-config",
            str(cfg),
            "--limit",
            "300",
        ],
    )
    assert out.exit_code == 0, out.output
    assert "ours" in out.stdout and "kpa" in out.stdout and "static" not in out.stdout
    cases = [
        (["--trace", str(tmp_path / "none.csv")], "no such trace"),
        (["--trace", str(shared_data / "azure2023_conv.csv"), "--profile", "nope"], "unknown profile"),
        (["--trace", str(shared_data / "azure2023_conv.csv"), "--policies", "x"], "unknown policy"),
        (["--trace", str(shared_data / "azure2023_conv.csv"), "--rate-scale", "0"], "rate scale"),
        (["--trace", str(shared_data / "azure2023_conv.csv"), "--slo-itl", "0"], "--slo-itl must be > 0"),
    ]
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("autoscaling:\n  min_replicas: 5\n  max_replicas: 2\n")
    cases.append(
        (
            ["--trace", str(shared_data / "azure2023_conv.csv"), "--deployment-config", str(bad_cfg)],
            "max_replicas",
        )
    )
    for args, why in cases:
        r = runner.invoke(app, ["simulate", *args])
        assert r.exit_code == 1 and why in r.output, (args, r.output)
