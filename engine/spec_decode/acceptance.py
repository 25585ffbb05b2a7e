"""Which draft tokens a verification step keeps, so outputs are exactly the target model's.

A verified sequence with drafts d_1..d_k gets k + 1 sampled rows: row j is the target's
next token after the sequence extended by d_1..d_j, drawn by the ordinary sampler (the
same penalties, truncation and per-output-index seeds as an unspeculated step). The output
is the longest prefix of rows whose token equals the next draft, plus the first row that
does not (or the bonus row after all k): rows t_0..t_m where m = `num_accepted`.

Greedy, that is exact argmax equality. Sampling, it is the standard speculative rule for a
deterministic draft (draft probability 1 on d): accept d with probability p(d), on reject
sample from normalize(max(p - onehot(d), 0)), i.e. p with d removed. Drawing t ~ p and
accepting iff t == d is that rule: P(accept) = p(d), and given t != d, t is distributed as
p restricted to the other tokens, renormalized. Every kept token is therefore distributed
as the target's, and row j's noise is the one an unspeculated step would draw for the same
output index, so a seeded request produces the same tokens with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def num_accepted(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts the target agreed with (`sampled` has len(drafts) + 1 rows)."""
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m


def accept_rows(
    rows: Sequence[T], sampled: Sequence[int], counts: Sequence[int], drafts: Sequence[Sequence[int]]
) -> tuple[list[T], list[int], list[int]]:
    """Keep each sequence's accepted rows.

    `rows` (any per-row value: token ids, logprobs), `sampled` (the token of each row) and the
    per-sequence row `counts` (len(drafts[i]) + 1) cover every sequence back to back. Returns
    the kept rows flat, the kept count per sequence, and the accepted draft count per sequence.
    """
    kept: list[T] = []
    kept_counts: list[int] = []
    accepted: list[int] = []
    at = 0
    for n, d in zip(counts, drafts, strict=True):
        m = num_accepted(sampled[at : at + n], d) if d else 0
        kept.extend(rows[at : at + m + 1])
        kept_counts.append(m + 1)
        accepted.append(m)
        at += n
    return kept, kept_counts, accepted
