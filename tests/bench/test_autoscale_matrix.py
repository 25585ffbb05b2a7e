"""`bench.autoscale_matrix`: the rule it reads each run set by, and a short run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.autoscale_matrix import PolicyRow, main, verdict


def row(within: float, gpu_hours: float = 10.0) -> PolicyRow:
    return PolicyRow(within_ttft_target=within, gpu_hours=gpu_hours, cold_starts=0)


@pytest.mark.parametrize(
    ("ours", "kpa", "target", "best_gpu_hours", "misses"),
    [
        (row(0.995, 12.0), row(0.9), 0.99, 10.0, []),
        (row(0.995, 12.6), row(0.9), 0.99, 10.0, ["> 1.25x"]),
        (row(0.985, 12.0), row(0.9), 0.99, 10.0, ["target"]),
        (row(0.94, 12.0), row(0.5), 0.934, 10.0, []),  # a ceiling target
        (row(0.995, 12.0), row(0.996), 0.99, 10.0, ["not ahead of kpa"]),
        (row(1.0, 12.0), row(1.0), 0.99, 10.0, []),  # both serve every request
        (row(0.5, 30.0), row(0.6), 0.99, 10.0, ["target", "> 1.25x", "not ahead of kpa"]),
    ],
)
def test_rule(
    ours: PolicyRow, kpa: PolicyRow, target: float, best_gpu_hours: float, misses: list[str]
) -> None:
    assert verdict(ours, kpa, target, best_gpu_hours) == misses


def test_a_short_matrix_prints_a_table_per_profile_and_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_SHARED_DATA", str(tmp_path / "absent"))
    out = tmp_path / "m.json"
    sets = main(
        [
            "--traces",
            "bursty,azure",
            "--seeds",
            "4",
            "--duration-s",
            "900",
            "--profiles",
            "llama2-70b-h100-tp4",
            "--rates",
            "1,1.5",
            "--limit",
            "360",
            "--json",
            str(out),
        ]
    )
    got = capsys.readouterr()
    assert "skipped azure" in got.err and "absent" in got.err
    assert [(s.trace, s.rate) for s in sets] == [("bursty-code-s4", 1.0), ("bursty-code-s4", 1.5)]
    assert got.out.count("ours against its best fixed fleet") == 2 and "meet the rule" in got.out
    for s in sets:
        assert s.best_replicas >= 1 and s.ours_vs_best == pytest.approx(
            s.ours.gpu_hours / s.best_gpu_hours, abs=1e-3
        )
        assert s.meets == (not s.misses)
    assert len(json.loads(out.read_text())) == 2
