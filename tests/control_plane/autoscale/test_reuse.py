"""Reuse curves answer, from one pass, what an LRU prefix cache of any size holds of each
prompt: checked against the simulated replica's own cache replayed at each size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sim.prefix_cache import PrefixCacheModel
from control_plane.autoscale.reuse import FleetReuse
from fleet_base.reuse_curve import ReuseCurves, StackDistances, hit_tokens, prompt_curve

BLOCK = 16


def _prompts(roots: list[list[int]], picks: list[tuple[int, int, int]]) -> list[tuple[int, ...]]:
    """Prompts that share prefixes: a root's first k blocks, then a few blocks of their own."""
    out, fresh = [], 10**9
    for root, k, tail in picks:
        r = roots[root % len(roots)]
        own = list(range(fresh, fresh + tail))
        fresh += tail
        out.append(tuple(r[: 1 + k % len(r)] + own))
    return out


@settings(max_examples=60, deadline=None)
@given(
    roots=st.lists(
        st.lists(st.integers(0, 10**6), min_size=1, max_size=12, unique=True), min_size=1, max_size=8
    ),
    picks=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(0, 4)), min_size=1, max_size=120
    ),
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=4),
)
def test_curves_match_an_lru_replayed_at_each_size(roots, picks, sizes) -> None:
    prompts = _prompts(roots, picks)
    curves = ReuseCurves(64 * BLOCK, BLOCK)  # compacts often: 64 blocks deep, 4 x 64 + 64 accesses
    caches = {c: PrefixCacheModel(c) for c in sizes}
    for blocks in prompts:
        tokens = len(blocks) * BLOCK + 3
        curve = curves.observe(blocks, tokens)
        for c, cache in caches.items():
            held = cache.lookup(blocks)
            cache.insert(blocks)
            assert hit_tokens(curve, c * BLOCK) == min(held * BLOCK, tokens - 1), (c, blocks)


def test_a_block_deeper_than_the_limit_is_forgotten() -> None:
    d = StackDistances(limit_blocks=2)
    for b in (1, 2, 3):
        d.touch(b)
    assert d.distance(3) == 0 and d.distance(2) == 1
    assert d.distance(1) is None  # two distinct blocks since: a miss at every size asked about
    with pytest.raises(ValueError):
        StackDistances(0)


def test_a_curve_steps_at_the_deepest_block_of_each_prefix() -> None:
    # Distances 0, 5, 2 then a miss: the first block at any size, two at more than 5 blocks.
    curve = prompt_curve([0, 5, 2, None, 0], BLOCK, 100)
    assert curve == ((0, 16), (5 * BLOCK, 48))
    assert [hit_tokens(curve, c * BLOCK) for c in (0, 1, 5, 6, 99)] == [0, 16, 16, 48, 48]
    assert prompt_curve([0, 0], BLOCK, 20) == ((0, 19),)  # never the last prompt token


def test_a_larger_fleet_caches_at_least_as_much() -> None:
    curves = ReuseCurves(1000 * BLOCK, BLOCK)
    prompts = _prompts([list(range(40)), list(range(100, 130))], [(i % 2, 7 * i, i % 3) for i in range(60)])
    seen = [curves.observe(p, len(p) * BLOCK) for p in prompts]
    reuse = FleetReuse(tuple(len(p) * BLOCK for p in prompts), tuple(seen))
    shares = [reuse.at(c * BLOCK)[0] for c in (0, 4, 16, 64, 1000)]
    assert shares[0] == 0.0 and shares == sorted(shares) and shares[-1] > 0.5
    share, fresh = reuse.at(1000 * BLOCK)
    assert len(fresh) == len(prompts) and all(f >= 1 for f in fresh)
    assert share == pytest.approx(1 - sum(fresh) / sum(len(p) * BLOCK for p in prompts))
