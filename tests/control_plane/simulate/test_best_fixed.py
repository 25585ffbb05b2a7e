"""The best fixed fleet: the search over static counts (against attainment curves whose answer
is known), and `compare` / `fleetctl simulate` reading every policy against it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from control_plane.autoscale import AutoscaleSettings
from control_plane.cli import app
from control_plane.simulate import compare
from control_plane.simulate.best_fixed import CEILING_MAX, search
from control_plane.simulate.des import Simulation
from control_plane.simulate.report import PolicyReport, summarize
from control_plane.simulate.trace import TraceRequest
from tests.control_plane.simulate.test_simulate import PROFILE


def no_queue(n: int) -> float:
    return 0.0


def overloaded_below(m: int) -> Callable[[int], float]:
    """A p99 queue that falls as the fleet grows, gone from `m` replicas."""
    return lambda n: 5.0 * m / n if n < m else 0.0


def fake(
    curve: Callable[[int], float], calls: list[int] | None = None, queue: Callable[[int], float] = no_queue
) -> Callable[[int], PolicyReport]:
    """A static run whose attainment is `curve(count)` and p99 queue `queue(count)`, at one
    GPU-hour per replica."""

    def run(n: int) -> PolicyReport:
        if calls is not None:
            calls.append(n)
        return PolicyReport.model_construct(
            policy="static",
            within_ttft_target=curve(n),
            gpu_hours=float(n),
            queue_p99_s=queue(n),
            timeline=[],
        )

    return run


@pytest.mark.parametrize(
    ("curve", "queue", "start", "replicas", "target", "basis"),
    [
        # reaches 99% from 7 replicas; started above and below the answer
        (lambda n: 0.995 if n >= 7 else 0.9, overloaded_below(7), 20, 7, 0.99, "99%"),
        # below, 2, 4 and 8 replicas plateau at 90% (the bursts overwhelm them), their queue falling
        (lambda n: 0.995 if n >= 7 else 0.9, overloaded_below(7), 2, 7, 0.99, "99%"),
        (lambda n: 0.995 if n >= 11 else 0.9, overloaded_below(11), 2, 11, 0.99, "99%"),
        (lambda n: 1.0, no_queue, 9, 1, 0.99, "99%"),
        # saturates at 94% (6% of requests too long for the target): ceiling - 0.5 points
        (lambda n: min(0.94, 0.1 * n), overloaded_below(10), 3, 10, 0.935, "ceiling - 0.5 points"),
        (lambda n: min(0.94, 0.1 * n), overloaded_below(10), 50, 10, 0.935, "ceiling - 0.5 points"),
        # no gain from doubling and a queue that stays: a plateau more replicas cannot lift
        (lambda n: 0.94, lambda n: 3.0, 4, 1, 0.935, "ceiling - 0.5 points"),
    ],
)
def test_smallest_count_reaching_the_target(
    curve: Callable[[int], float],
    queue: Callable[[int], float],
    start: int,
    replicas: int,
    target: float,
    basis: str,
) -> None:
    best = search(fake(curve, queue=queue), start)
    assert (best.replicas, best.target, best.target_basis) == (replicas, pytest.approx(target), basis)
    assert best.within_ttft_target == curve(replicas) and best.gpu_hours == replicas
    assert best.ceiling_saturated and not best.non_monotone
    assert [n for n, _ in best.runs] == sorted({n for n, _ in best.runs})


def test_ceiling_is_what_a_very_large_fleet_reaches() -> None:
    calls: list[int] = []
    # Creeps up slowly: each doubling still gains, until 160 replicas reach 93.9%.
    best = search(fake(lambda n: min(0.939, 0.5 + 0.0028 * n), calls), 20)
    assert best.ceiling == 0.939 and best.ceiling_replicas == 320 and best.ceiling_saturated
    assert best.target == pytest.approx(0.934) and "320 replicas reach 93.90%" in best.why
    assert 0.5 + 0.0028 * (best.replicas - 1) < 0.934 <= best.within_ttft_target
    assert len(calls) == len(set(calls))  # each count simulated once
    # Never saturating: cut at the cap, and said.
    cut = search(fake(lambda n: 0.5 + 0.4 * n / (2 * CEILING_MAX)), 512)
    assert cut.ceiling_replicas == CEILING_MAX and not cut.ceiling_saturated and "cap" in cut.why


def test_a_pass_just_below_a_failing_count_is_found() -> None:
    # 5 passes, 6 fails (a routing accident), 7 and up pass: bisection alone stops at 7.
    dips = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.9, 5: 0.991, 6: 0.985}
    best = search(fake(lambda n: dips.get(n, 0.995)), 16)
    assert best.replicas == 5 and best.non_monotone and "not monotone" in best.why


@given(
    steps=st.lists(st.floats(0.0, 0.2), min_size=1, max_size=40),
    start=st.integers(1, 60),
)
def test_monotone_curves_give_the_smallest_passing_count(steps: list[float], start: int) -> None:
    def curve(n: int) -> float:
        return round(min(1.0, sum(steps[:n])), 5)

    best = search(fake(curve), start)
    assert curve(best.replicas) >= best.target
    assert best.replicas == 1 or curve(best.replicas - 1) < best.target
    assert not best.non_monotone
    if best.ceiling >= 0.99:
        assert best.target == 0.99
    else:
        assert best.target == pytest.approx(best.ceiling - 0.005)


def steady(rate: float, seconds: float, start: float = 0.0, prompt: int = 800) -> list[TraceRequest]:
    return [TraceRequest(start + i / rate, prompt, 30) for i in range(int(rate * seconds))]


def static_attainment(trace: list[TraceRequest], n: int, slo: float) -> float:
    s = AutoscaleSettings(min_replicas=n, max_replicas=n, target_concurrency=4, profile=PROFILE)
    run = Simulation(trace, PROFILE, s, "static", initial_replicas=n).run()
    return summarize(run, PROFILE, slo).within_ttft_target


def test_compare_reads_every_policy_against_the_best_fixed_fleet() -> None:
    trace = steady(2.0, 120) + steady(25.0, 60, start=120) + steady(2.0, 120, start=180)
    s = AutoscaleSettings(min_replicas=1, max_replicas=20, target_concurrency=4)
    rep = compare(trace, PROFILE, s, slo_ttft_s=0.5, warmup_s=0, policies=("static", "kpa", "ours"))
    best = rep.best_fixed
    assert best is not None and best.target == 0.99 and best.target_basis == "99%"
    assert static_attainment(trace, best.replicas, 0.5) == best.within_ttft_target >= 0.99
    assert best.replicas == 1 or static_attainment(trace, best.replicas - 1, 0.5) < 0.99
    assert best.gpu_hours == best.summary.gpu_hours > 0 and best.summary.timeline == []
    for p in rep.policies:
        assert p.gpu_hours_vs_best_fixed == pytest.approx(p.gpu_hours / best.gpu_hours, abs=1e-3)
        assert p.reaches_target == (p.within_ttft_target >= 0.99)
    static = next(p for p in rep.policies if p.policy == "static")
    assert static.replicas_max >= best.replicas and static.gpu_hours_vs_best_fixed >= 1
    assert compare(trace, PROFILE, s, warmup_s=0, policies=("kpa",), best_fixed=False).best_fixed is None


def test_requests_no_fleet_can_serve_set_the_ceiling() -> None:
    # One request in ten has a prompt whose own prefill takes 5 s, over a 1 s target.
    trace = [TraceRequest(i / 4, 50_000 if i % 10 == 0 else 500, 20) for i in range(4 * 240)]
    s = AutoscaleSettings(min_replicas=1, max_replicas=8, target_concurrency=4)
    rep = compare(trace, PROFILE, s, slo_ttft_s=1.0, warmup_s=0, policies=("static",))
    best = rep.best_fixed
    assert best is not None and best.target_basis == "ceiling - 0.5 points"
    assert best.ceiling <= 0.9 and best.target == pytest.approx(best.ceiling - 0.005)
    assert best.within_ttft_target >= best.target and best.replicas <= best.ceiling_replicas


def test_fleetctl_simulate_reports_the_best_fixed_fleet(tmp_path: Path) -> None:
    from bench.bursty_trace import generate, write_csv

    path = tmp_path / "bursty.csv"
    write_csv(generate(900, seed=2), path)
    runner = CliRunner()
    args = ["simulate", "--trace", str(path), "--limit", "420", "--policies", "kpa,ours"]
    out = runner.invoke(app, [*args, "--deployment-config", str(_short_warmup(tmp_path)), "-o", "json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    best = rep["best_fixed"]
    assert best["replicas"] >= 1 and best["gpu_hours"] > 0 and best["target"] >= 0.985
    assert {"within_ttft_target", "target_basis", "ceiling", "runs", "why"} <= set(best)
    for p in rep["policies"]:
        assert p["gpu_hours_vs_best_fixed"] == pytest.approx(p["gpu_hours"] / best["gpu_hours"], abs=1e-3)
        assert p["reaches_target"] == (p["within_ttft_target"] >= best["target"])
        assert "within_ttft_target" in p and "cold_starts" in p  # the fields as before
    table = runner.invoke(app, [*args, "--deployment-config", str(_short_warmup(tmp_path))])
    assert table.exit_code == 0, table.output
    assert f"best fixed ({best['replicas']})" in table.stdout and "best fixed fleet:" in table.stdout
    skipped = runner.invoke(app, [*args, "--no-best-fixed", "-o", "json"])
    assert skipped.exit_code == 0 and json.loads(skipped.stdout)["best_fixed"] is None


def _short_warmup(tmp_path: Path) -> Path:
    cfg = tmp_path / "dep.yaml"
    cfg.write_text("autoscaling: {}\nwarmup_s: 60\n")
    return cfg
