"""Continuing a generation another replica started, exactly where it stopped.

A continued request carries the token ids already generated. They become the sequence's
first output tokens before it is scheduled: the scheduler prefills prompt + those ids into
the KV cache like any prompt (the prefix cache applies), while everything that reads the
output sees them as output: `max_tokens` and `min_tokens` count them, the detokenizer and
the stop-string window are replayed over them token by token (so partial UTF-8 and a stop
string that straddles the hand-over behave as in the uninterrupted run), a grammar is
advanced over them, usage counts them, and streaming resumes after the text the original
replica had already released (the same hold-back of a possible stop-string prefix).

Seeded sampling is resumable because the noise of step k is drawn from a generator
re-seeded with `step_seed(seed, k)`: it depends only on the request's seed and how many
tokens it has generated, not on what ran before on this replica. Without a seed a
continuation samples from fresh randomness: the distribution is the same, the tokens are
not. Greedy decoding needs nothing (it is deterministic for the same tokens).
"""

from __future__ import annotations

from typing import Any, Protocol

from fleet_base.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A 63-bit seed for sampling step `step` of a request seeded with `seed` (splitmix64
    of the pair, so neighbouring seeds and steps give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def check_resume(params: SamplingParams, resume_token_ids: list[int], vocab_size: int) -> None:
    """Refuses a continuation the engine cannot continue faithfully (a ValueError: a 400)."""
    if params.n != 1:
        raise ValueError("a continuation (fleet_resume_token_ids) continues exactly one sequence (n = 1)")
    if params.pooling is not None:
        raise ValueError("an embedding request cannot be continued")
    bad = next((t for t in resume_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"resumed token id {bad} is outside the vocabulary [0, {vocab_size})")
    if params.max_tokens is not None and len(resume_token_ids) >= params.max_tokens:
        raise ValueError(
            f"{len(resume_token_ids)} resumed tokens leave nothing to generate within max_tokens "
            f"{params.max_tokens}"
        )


class _Sequence(Protocol):
    """What `prime` needs of the engine's SequenceState."""

    request: Any
    detok: Any
    text: str
    emitted_chars: int
    emitted_tokens: int


def prime(seq: _Sequence, resume_token_ids: list[int]) -> None:
    """Replays `resume_token_ids` into a fresh sequence as its output so far, and marks as
    already streamed what the original replica had released of it."""
    req = seq.request
    params: SamplingParams = req.sampling_params
    for token in resume_token_ids:
        req.append_output_token(token)
        seq.text += seq.detok.push([token])
        if req.grammar is not None and not req.grammar.accept_token(token):
            raise ValueError(f"resumed token id {token} is not allowed by the request's response format")
    hold = params.max_stop_len - 1 if params.stop else 0
    seq.emitted_chars = max(0, len(seq.text) - hold)
    seq.emitted_tokens = len(resume_token_ids)
