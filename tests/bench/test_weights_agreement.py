"""The weights agreement bench's near-tie gate: the rule tests/engine/test_correctness_hf.py
applies, on given reference choices and margins."""

from __future__ import annotations

from bench.weights_agreement import agreement, divergences, near_tie_failures


def test_departures_count_only_where_the_reference_was_not_at_a_near_tie() -> None:
    reference = {  # prompt -> (reference greedy choice per step, its top-2 margin per step)
        (1,): ([5, 6, 7, 8], [0.5, 0.5, 0.5, 0.5]),
        (2,): ([5, 6, 7, 8], [0.5, 0.01, 0.5, 0.5]),
        (3,): ([5, 6, 7, 8], [0.5, 0.5, 0.5, 0.5]),
    }

    def hf_top(prompt, stream):
        return reference[tuple(prompt)]

    prompts = [[1], [2], [3]]
    streams = [[5, 6, 7, 8], [5, 9, 9, 9], [5, 6, 0, 8]]  # identical, near-tie flip, real flip
    assert near_tie_failures(prompts, streams, hf_top) == [(2, 2, 0.5)]


def test_agreement_and_first_divergence_steps() -> None:
    ref = [[1, 2, 3, 4], [1, 2, 3, 4]]
    other = [[1, 2, 3, 4], [1, 9, 3, 4]]
    assert agreement(ref, other) == (0.5, 0.625)
    assert divergences(ref, other) == [1]
