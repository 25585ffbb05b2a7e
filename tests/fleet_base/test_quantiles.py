"""Evenly spaced weighted quantiles: the one cut of a length stream to a small sample."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_base.quantiles import evenly_spaced


@pytest.mark.parametrize(
    ("weighted", "count", "want"),
    [
        ([], 4, []),
        ([(7, 0.0)], 3, []),  # no weight: nothing to stand for
        ([(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)], 4, [1, 2, 3, 4]),
        ([(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)], 2, [2, 4]),  # the middles of two halves
        ([(100, 3.0), (5000, 1.0)], 4, [100, 100, 100, 5000]),  # a bucket of 3 stands for 3
        ([(100, 1.0), (900, 0.0), (5000, 1.0)], 2, [100, 5000]),  # an empty bucket is never chosen
        ([(10, 1.0), (20, 9.0)], 1, [20]),  # the weighted median, not the middle value
    ],
)
def test_evenly_spaced(weighted: list[tuple[int, float]], count: int, want: list[int]) -> None:
    assert evenly_spaced(weighted, count) == want


@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=200), st.integers(1, 64))
def test_unit_weights_pick_the_spread_quantiles_of_sorted_values(values: list[int], count: int) -> None:
    """Unit weights: the value at index floor((i + 1/2) n / k) of the sorted values, so the
    sample's spread is the stream's, whatever order the lengths came in."""
    ordered = sorted(values)
    k = min(count, len(ordered))
    got = evenly_spaced(((x, 1.0) for x in ordered), k)
    assert got == [ordered[int((i + 0.5) * len(ordered) / k)] for i in range(k)]
