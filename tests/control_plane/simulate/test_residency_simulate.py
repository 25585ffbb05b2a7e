"""`fleetctl simulate --residency-shares`: each jurisdiction's requests on a fleet of its
own against one shared fleet, and what that costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control_plane.autoscale import AutoscaleSettings
from control_plane.cli import app
from control_plane.simulate import compare
from control_plane.simulate.des import RunResult, Sample
from control_plane.simulate.residency import cost_lines, merge, parse_shares, split_trace
from tests.control_plane.simulate.test_simulate import PROFILE, steady


@pytest.mark.parametrize(
    "text, shares",
    [
        ("ca=1", {"ca": 1.0}),
        ("ca=1,US=3", {"ca": 0.25, "us": 0.75}),
        (" eu = 0.5 , ca=0.5", {"eu": 0.5, "ca": 0.5}),
    ],
)
def test_parse_shares(text, shares):
    assert parse_shares(text) == pytest.approx(shares)


@pytest.mark.parametrize(
    "text, why",
    [
        ("ca", "JURISDICTION=SHARE"),
        ("ca=0", "positive"),
        ("ca=x", "not a number"),
        ("ca=1,ca=2", "twice"),
        ("C A=1", "jurisdiction"),
    ],
)
def test_parse_shares_rejects(text, why):
    with pytest.raises(ValueError, match=why):
        parse_shares(text)


def test_split_is_a_seeded_partition_by_share():
    trace = steady(10.0, 100)
    parts = split_trace(trace, {"ca": 0.3, "us": 0.7})
    assert parts == split_trace(trace, {"ca": 0.3, "us": 0.7})
    assert sorted(r.at for part in parts.values() for r in part) == [r.at for r in trace]
    assert 0.25 < len(parts["ca"]) / len(trace) < 0.35


def test_merge_adds_fleets_up():
    def run(samples, seconds, cold):
        return RunResult(
            "ours", [], [Sample(t, n, n, n, 0.0, 1) for t, n in samples], seconds, cold, end=10.0
        )

    merged = merge([run([(0.0, 1), (2.0, 3)], 100.0, 1), run([(1.0, 2)], 50.0, 2)])
    assert [(s.at, s.replicas) for s in merged.samples] == [(0.0, 1), (1.0, 3), (2.0, 5)]
    assert (merged.replica_seconds, merged.cold_starts) == (150.0, 3)


def test_separate_fleets_cost_more_than_one_shared():
    """A light load fits one replica; split over two jurisdictions it needs one each."""
    trace = steady(0.5, 600)
    s = AutoscaleSettings(min_replicas=1, max_replicas=4, target_concurrency=4)
    rep = compare(
        trace,
        PROFILE,
        s,
        slo_ttft_s=2.0,
        warmup_s=0,
        policies=("static",),
        residency_shares={"ca": 0.5, "us": 0.5},
    )
    shared, bound = rep.policies
    assert (shared.residency, bound.residency) == ("", "ca 50%, us 50%")
    assert shared.requests == bound.requests == len(trace)
    assert rep.static_replicas == 1 and rep.residency_static_replicas == {"ca": 1, "us": 1}
    assert bound.gpu_hours == pytest.approx(2 * shared.gpu_hours, rel=0.05)  # each fleet ends with its part
    assert cost_lines(rep)[0].startswith(
        f"residency (ca 50%, us 50%) static/prefix: +{bound.gpu_hours - shared.gpu_hours:.2f}"
    )


def test_fleetctl_simulate_residency(shared_data: Path) -> None:
    runner = CliRunner()
    trace = str(shared_data / "azure2023_conv.csv")
    args = ["simulate", "--trace", trace, "--policies", "ours", "--limit", "240"]
    out = runner.invoke(app, [*args, "--residency-shares", "ca=0.3,us=0.7", "-o", "json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    assert rep["residency_shares"] == pytest.approx({"ca": 0.3, "us": 0.7})
    assert [p["residency"] for p in rep["policies"]] == ["", "ca 30%, us 70%"]
    text = runner.invoke(app, [*args, "--residency-shares", "ca=0.3,us=0.7"])
    assert text.exit_code == 0 and "residency (ca 30%, us 70%) ours/prefix:" in text.stdout
    bad = runner.invoke(app, [*args, "--residency-shares", "ca=-1"])
    assert bad.exit_code == 1 and "--residency-shares" in bad.output
