"""`bench.bursty_trace`: on/off arrivals whose statistics, measured on the generated trace,
are those of bursty coding traffic, at every seed tried (not one tuned seed)."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from bench.bursty_trace import SHAPES, bursts, describe, generate, main, window_tokens
from control_plane.simulate.trace import load_trace

SEEDS = (1, 2, 3)
HOUR = 3600.0


@pytest.mark.parametrize("seed", SEEDS)
def test_code_shape_has_bursts_of_long_prompts_between_quiet_minutes(seed: int) -> None:
    rows = generate(HOUR, seed)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(rows)) and 0 <= rows[0][0] < rows[-1][0] < HOUR
    st = describe(rows, HOUR)
    assert 2000 < st.prompt_tokens_per_s < 9000  # a coding assistant's hour: about 5k tok/s
    assert 8 <= st.peak_10s_ratio <= 20  # the busiest 10 s reach 10-15x the mean
    assert st.gap_median_s >= 60  # minutes of near-silence between bursts ...
    assert st.gap_p90_s >= 1.5 * st.gap_median_s  # ... some much longer than the typical one
    assert st.burst_prompt_mean >= 1.4 * st.quiet_prompt_mean  # bursts bring the long prompts
    windows = window_tokens(rows, HOUR)
    mean = sum(windows) / len(windows)
    quiet = [w for w in windows if w <= 3 * mean]
    assert sum(quiet) / len(quiet) <= 0.5 * mean  # the lulls are a low background
    assert sum(1 for w in windows if w > 3 * mean) <= 0.2 * len(windows)  # on a minority of windows


def test_gaps_between_bursts_are_heavy_tailed() -> None:
    s = SHAPES["code"]
    gaps, lengths = [], []
    for seed in SEEDS:
        on = bursts(6 * HOUR, seed)
        gaps += [b[0] - a[1] for a, b in itertools.pairwise(on)]
        lengths += [end - start for start, end in on[:-1]]
    lengths.sort()
    assert 15 <= statistics.median(lengths) <= 30 and lengths[len(lengths) // 10] >= 5  # tens of seconds
    assert lengths[-len(lengths) // 10] <= 60
    assert min(gaps) >= s.gap_min_s and max(gaps) <= s.gap_max_s + 1e-6
    # Pareto(1.5) from 60 s: median 95 s, and one gap in eight over 4 minutes (an exponential
    # with that median would put one in 170 there).
    assert 75 <= statistics.median(gaps) <= 120
    assert 0.06 <= sum(g > 4 * s.gap_min_s for g in gaps) / len(gaps) <= 0.25
    assert max(gaps) >= 8 * s.gap_min_s


def test_same_seed_same_trace_other_seed_other_trace(tmp_path: Path) -> None:
    assert generate(900, 5) == generate(900, 5)
    assert generate(900, 5) != generate(900, 6)
    assert generate(900, 5, "dense") != generate(900, 5)
    with pytest.raises(ValueError, match="unknown shape"):
        generate(60, 1, "nope")
    out = tmp_path / "b.csv"
    main([str(out), "--duration-s", "900", "--seed", "5", "--shape", "sharp"])
    rows = generate(900, 5, "sharp")
    trace = load_trace(out)  # the Azure CSV `fleetctl simulate --trace` reads
    assert len(trace) == len(rows)
    assert trace[-1].at == pytest.approx(rows[-1][0] - rows[0][0], abs=1e-3)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace[:50]] == [(p, o) for _, p, o in rows[:50]]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_is_bursty(shape: str) -> None:
    for seed in SEEDS:
        st = describe(generate(HOUR, seed, shape), HOUR)
        assert st.peak_10s_ratio >= 6 and st.burst_prompt_mean > st.quiet_prompt_mean, (seed, st)
