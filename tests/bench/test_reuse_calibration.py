"""The reuse calibration bench on the Mooncake trace: the model credited with the fleet's
caches tracks the simulator's reuse and attainment, where the model without reuse misses
the attainment by tens of points."""

from __future__ import annotations

from pathlib import Path

from bench.reuse_calibration import main, rows


def test_the_model_with_the_fleets_caches_tracks_the_simulator(shared_data: Path) -> None:
    (r,) = rows(shared_data / "mooncake_synthetic_trace.jsonl", "llama2-70b-h100-tp4", [26], 1.0)
    assert abs(r["model_reuse"] - r["sim_reuse"]) < 0.05, r
    assert abs(r["model_within"] - r["sim_within"]) < 0.03, r
    assert r["sim_within"] - r["plain_within"] > 0.15, r  # what the model without reuse leaves out


def test_the_bench_prints_a_table_per_profile(shared_data: Path, capsys) -> None:
    trace = shared_data / "mooncake_synthetic_trace.jsonl"
    assert main(["--trace", str(trace), "--profiles", "h100", "--fleets", "13", "--rate", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "llama2-70b-h100-tp4" in out and "sim reuse" in out and "13" in out
