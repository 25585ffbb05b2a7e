"""Keeps bench/placement.py from rotting: its smallest size on the real catalogs."""

from __future__ import annotations

import pytest

from bench import placement

needs_data = pytest.mark.skipif(
    not all((placement.DATA / c).exists() for c in placement.CATALOGS), reason="shared catalogs absent"
)


@needs_data
def test_placement_bench_smallest_size(capsys):
    assert placement.main(["--sizes", "50", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "LP bound" in out and "50" in out
    row = placement.run(50, 5.0)
    assert row.violations == 0 and row.milp_unplaced == 0
    assert row.lp_bound <= row.milp_cost <= row.ffd_cost
    assert sum(d.count for d in placement.make_demands(50)) == 50
    assert len(placement.make_demands(50)) == 20
