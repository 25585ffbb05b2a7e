"""bench.fit_profile against a real engine replica on a tiny random checkpoint: the
fitted profile is valid, monotone, and a simulated replica serves with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fit_profile
from fleet_base.profile import load_profile
from tests.agent.conftest import make_tiny_model_dir


def test_fit_monotone_points() -> None:
    prof = fit_profile.fit(
        "x", {16: 0.02, 64: 0.01, 256: 0.05}, {1: 0.01, 4: 0.009, 8: 0.02},
        kv_capacity_tokens=1000, max_num_seqs=8, cold_start_s=1.234, description="t",
    )  # fmt: skip
    assert prof.prefill_s == [0.02, 0.02, 0.05] and prof.decode_step_s == [0.01, 0.01, 0.02]
    assert prof.cold_start_s == 1.23 and prof.max_prefill_tokens == 256


@pytest.mark.slow
def test_fit_profile_launches_measures_and_writes(tmp_path: Path, capsys) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "tiny-cpu.json"
    code = fit_profile.main([
        "--launch", "--model", str(model), "--name", "tiny-cpu", "--prompt-sizes", "8,64",
        "--batches", "1,2", "--decode-tokens", "4", "--repeats", "1", "--out", str(out), "--", "--threads", "1",
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "prefill s" in printed and "wrote" in printed
    prof = load_profile(out)
    assert prof.prefill_tokens == [8.0, 64.0] and prof.decode_batch == [1.0, 2.0]
    assert 0 < prof.prefill_s[0] <= prof.prefill_s[1] < 10
    assert prof.cold_start_s > 0 and prof.max_num_seqs == 2
    assert json.loads(out.read_text())["source"].startswith("bench.fit_profile")
