"""Speculative decoding, pure parts: the n-gram drafter, the acceptance rule (greedy prefix,
sampled distribution), the scheduler's draft chunks and the KV rollback, the setting."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineArgs
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler
from engine.server.spec_flags import add_speculative_flags, speculative_config
from engine.spec_decode.acceptance import accept_rows, num_accepted
from engine.spec_decode.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DEFAULT_SPECULATIVE_CONFIG,
    SpeculativeConfig,
)
from engine.spec_decode.decoder import SpeculativeDecoder
from engine.spec_decode.gate import BACKOFF_MAX_SKIP, Backoff, backoff_skip, drafts_this_step
from engine.spec_decode.ngram import NgramIndex, propose_ngram
from fleet_base.sampling_params import SamplingParams

# -- the drafter ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "want"),
    [
        ([1, 2, 3, 4], 3, 1, 3, []),  # nothing repeats
        ([1, 2, 3, 4, 1, 2], 3, 1, 2, [3, 4, 1]),  # the bigram (1, 2) was followed by 3, 4, 1
        ([7, 1, 9, 2, 1, 3, 7, 1], 3, 1, 2, [9, 2, 1]),  # the longest n wins: (7, 1) over (1,)
        ([7, 1, 9, 2, 1, 3, 7, 1], 3, 1, 1, [3, 7, 1]),  # unigram: its latest occurrence
        ([1, 2, 1, 3, 1], 1, 1, 1, [3]),  # latest earlier occurrence, not the first
        ([4, 5, 4, 5], 4, 2, 2, [4, 5, 4, 5]),  # a period shorter than k repeats
        ([8, 8, 8], 3, 1, 3, [8, 8, 8]),
        ([1, 2, 3, 1], 3, 2, 3, []),  # only a unigram matches, below min_n
        ([1, 2, 3, 1], 3, 1, 3, [2, 3, 1]),
        ([1, 2, 3, 1, 2], 0, 1, 3, []),  # no room for drafts
        ([5], 3, 1, 3, []),
        ([], 3, 1, 3, []),
    ],
)
def test_ngram_table(tokens, k, min_n, max_n, want):
    assert propose_ngram(tokens, k, min_n, max_n) == want


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: longest n, latest earlier occurrence, periodic continuation."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        tail = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[start + n + j])
                return seq[size:]
    return []


@settings(max_examples=120, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_incremental_matches_brute_force(tokens, cuts, k, min_n, extra):
    index = NgramIndex(min_n, min_n + extra)
    at = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        index.append(tokens[at:cut])  # appended in pieces, as a generation grows
        at = cut
        assert index.propose(k) == _reference(tokens[:cut], k, min_n, min_n + extra)


# -- the acceptance rule -------------------------------------------------------------------


def _toy_argmax(context: list[int]) -> int:
    """A deterministic 'target model' over a vocabulary of 5."""
    return (sum(context) * 7 + len(context) * 3 + context[-1]) % 5


@settings(max_examples=150, deadline=None)
@given(
    context=st.lists(st.integers(0, 4), min_size=1, max_size=8),
    drafts=st.lists(st.integers(0, 4), max_size=6),
    follow=st.booleans(),
)
def test_greedy_acceptance_is_the_longest_matching_prefix(context, drafts, follow):
    if follow:  # drafts that agree with the target for a while, then maybe not
        seq = list(context)
        for i in range(len(drafts)):
            seq.append(_toy_argmax(seq) if i < len(drafts) - 1 else drafts[i])
        drafts = seq[len(context) :]
    rows = [_toy_argmax(context + drafts[:j]) for j in range(len(drafts) + 1)]
    kept, counts, accepted = accept_rows(rows, rows, [len(rows)], [drafts])
    m = next((i for i, (t, d) in enumerate(zip(rows, drafts)) if t != d), len(drafts))
    assert accepted == [m] == [num_accepted(rows, drafts)]
    assert counts == [m + 1]
    # the kept tokens are the target's own greedy continuation, m + 1 of them
    seq = list(context)
    for _ in range(m + 1):
        seq.append(_toy_argmax(seq))
    assert kept == seq[len(context) :]


# The target distribution of the statistical test: next-token probabilities given the last token.
_P = torch.tensor(
    [
        [0.50, 0.30, 0.15, 0.05],
        [0.10, 0.20, 0.60, 0.10],
        [0.25, 0.25, 0.25, 0.25],
        [0.05, 0.05, 0.10, 0.80],
    ],
    dtype=torch.float64,
)
_CHI2_DF15_P0001 = 37.70  # chi-square critical value, 15 degrees of freedom, p = 0.001


def _chi2(pairs: torch.Tensor, first: int) -> float:
    expected = (_P[first][:, None] * _P).reshape(-1) * pairs.shape[0]
    observed = torch.bincount(pairs[:, 0] * 4 + pairs[:, 1], minlength=16).double()
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafts", [[1, 2], [3, 3], [0, 0]])
def test_sampled_acceptance_preserves_the_target_distribution(drafts):
    """Two tokens after token 0, generated by speculation with fixed drafts: the rows are drawn
    from the target (as the engine's sampler draws them), kept by `accept_rows`, and a normal
    step follows when only one was kept. The joint of the two tokens must be the target's;
    the textbook rule (accept d with p(d), else sample the residual) must agree."""
    n = 20_000
    g = torch.Generator().manual_seed(1234)
    ctx = 0
    contexts = [ctx, *drafts]  # row j's context ends with d_j

    def draw(probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, n, replacement=True, generator=g)

    rows = torch.stack([draw(_P[c]) for c in contexts], 1).tolist()
    nexts = torch.stack([draw(_P[t]) for t in range(4)], 1).tolist()  # an ordinary step after t
    pairs = []
    for i in range(n):
        kept, _, _ = accept_rows(rows[i], rows[i], [len(rows[i])], [drafts])
        if len(kept) == 1:  # one kept: the next token comes from an ordinary step
            kept.append(nexts[i][kept[0]])
        pairs.append(kept[:2])
    assert _chi2(torch.tensor(pairs), ctx) < _CHI2_DF15_P0001

    # The textbook form, for comparison: accept d with probability p(d), else draw from
    # normalize(max(p - onehot(d), 0)).
    d1, d2 = drafts

    def residual(p: torch.Tensor, d: int) -> torch.Tensor:
        r = torch.clamp(p - torch.nn.functional.one_hot(torch.tensor(d), 4).double(), min=0)
        return r / r.sum()

    u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    ok1 = u[:, 0] < _P[ctx][d1]
    x1 = torch.where(ok1, torch.full((n,), d1), draw(residual(_P[ctx], d1)))
    after_reject = torch.stack([draw(_P[t]) for t in range(4)], 1).gather(1, x1[:, None])[:, 0]
    ok2 = u[:, 1] < _P[d1][d2]
    x2_accepted = torch.where(ok2, torch.full((n,), d2), draw(residual(_P[d1], d2)))
    x2 = torch.where(ok1, x2_accepted, after_reject)
    assert _chi2(torch.stack([x1, x2], 1), ctx) < _CHI2_DF15_P0001


def test_chi2_detects_a_wrong_distribution():
    """The statistic above has power: greedy 'acceptance' of always-the-draft fails it."""
    n = 20_000
    g = torch.Generator().manual_seed(99)
    first = torch.multinomial(_P[0], n, replacement=True, generator=g)
    wrong = torch.stack([first, torch.full((n,), 2)], 1)
    assert _chi2(wrong, 0) > 10 * _CHI2_DF15_P0001
    assert not math.isnan(_chi2(wrong, 0))


# -- the scheduler's draft chunks and the KV rollback --------------------------------------


def _running(sched: Scheduler, prompt: list[int], first: int, max_tokens: int = 64) -> Request:
    """A request past its prefill, with its first sampled token `first` appended."""
    req = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), max_model_len=256)
    sched.add_request(req)
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_output_token(first)
    return req


def test_draft_chunk_is_scheduled_verified_and_rolled_back():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = _running(sched, [1, 2, 3, 1, 2, 3, 1], first=2)  # 8 tokens in 2 blocks
    spec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1), 256)
    spec.propose(sched.running)
    assert req.spec_token_ids == [3, 1, 2, 3, 1]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.num_draft_tokens, s.samples) == (6, 5, True)
    assert len(kv.get_block_ids("r")) == 4  # 13 slots
    free_before = kv.num_free_blocks()
    sched.update_after_step(out)
    for t in [3, 9]:  # one draft accepted, then the target's own token
        req.append_output_token(t)
    spec.after_verify(req, 5, 1, kv)
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert len(kv.get_block_ids("r")) == 3  # the block holding only rejected slots went back
    assert kv.num_free_blocks() == free_before + 1
    assert req.spec_token_ids == []
    assert (spec.num_drafts, spec.num_draft_tokens, spec.acceptance_rate) == (1, 5, 0.2)
    # every cached block is full of real tokens: no draft slot was ever registered
    cached = {b for _, b in kv.block_pool.cached_items()}
    assert cached and cached <= set(kv.get_block_ids("r")[: req.num_tokens // 4])


def test_drafts_fit_max_tokens_and_the_budget():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=3)
    req = _running(sched, [1, 2, 1], first=2, max_tokens=3)
    spec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1), 256)
    spec.propose(sched.running)
    assert req.spec_token_ids == [1]  # 2 more tokens fit max_tokens: 1 draft + the target's next
    req.spec_token_ids = [1, 2, 1, 2]
    (s,) = sched.schedule().scheduled
    assert (s.num_new_tokens, s.num_draft_tokens, req.spec_token_ids) == (3, 2, [1, 2])  # budget 3


def test_drafts_are_dropped_before_anyone_is_preempted():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = _running(sched, [1, 2, 1, 2, 1, 2, 1], first=2)  # 2 blocks held
    other = Request("o", [9, 9, 9], SamplingParams(max_tokens=1), max_model_len=256)
    assert kv.allocate_slots(other, 4)  # the last free block
    req.spec_token_ids = [1, 2, 1, 2, 1]  # would need 2 more blocks
    out = sched.schedule()
    (s,) = out.scheduled
    assert not out.preempted and req in sched.running
    assert (s.num_new_tokens, s.num_draft_tokens, req.spec_token_ids) == (1, 0, [])


def test_grammar_sequences_get_no_drafts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = _running(sched, [1, 2, 1, 2, 1, 2, 1], first=2)
    req.grammar = object()  # any matcher
    SpeculativeDecoder(SpeculativeConfig(), 256).propose(sched.running)
    assert req.spec_token_ids == []


# -- the setting ---------------------------------------------------------------------------


def _flags(argv: list[str]) -> SpeculativeConfig | None:
    p = argparse.ArgumentParser()
    add_speculative_flags(p)
    return speculative_config(p.parse_args(argv))


def test_flags_and_engine_args():
    assert _flags([]) == DEFAULT_SPECULATIVE_CONFIG
    assert _flags(["--speculative", "ngram"]) == SpeculativeConfig()
    cfg = _flags(
        ["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "5", "--ngram-min", "3"]
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 3)
    js = _flags(
        ["--speculative-config", '{"method": "ngram", "prompt_lookup_max": 6}', "--prompt-lookup-min", "1"]
    )
    assert (js.prompt_lookup_max, js.prompt_lookup_min) == (6, 1)
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineArgs().speculative_config == DEFAULT_SPECULATIVE_CONFIG
    assert _flags([]) == DEFAULT_SPECULATIVE_CONFIG


def test_field_flags_alone_adjust_the_default():
    if DEFAULT_SPECULATIVE_CONFIG is None:
        with pytest.raises(ValueError, match="--speculative ngram"):
            _flags(["--num-speculative-tokens", "3"])
    else:
        cfg = _flags(["--num-speculative-tokens", "3"])
        assert cfg == DEFAULT_SPECULATIVE_CONFIG.model_copy(update={"num_speculative_tokens": 3})


def test_gate_flags_and_turning_it_off():
    assert _flags(["--speculative", "none"]) is None
    cfg = _flags(["--speculative", "ngram", "--speculative-disable-by-batch-size", "8"])
    assert cfg.disable_by_batch_size == 8
    js = _flags(["--speculative-config", '{"method": "ngram", "disable_by_batch_size": 2}'])
    assert js.disable_by_batch_size == 2
    assert _flags(["--speculative", "ngram"]).disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    ungated = SpeculativeConfig(disable_by_batch_size=None)
    assert EngineArgs(
        speculative_config={"method": "ngram", "disable_by_batch_size": None}
    ).speculative_config == (ungated)


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
        ["--speculative", "ngram", "--num-speculative-tokens", "0"],
        ["--speculative-config", '{"method": "eagle"}'],
        ["--speculative", "ngram", "--speculative-disable-by-batch-size", "0"],
        ["--speculative", "none", "--num-speculative-tokens", "3"],
    ],
)
def test_bad_settings_are_refused(argv):
    with pytest.raises(ValueError):
        _flags(argv)


def test_server_flags_reach_the_engine_and_metrics():
    from prometheus_client import generate_latest

    from engine.outputs import EngineStats
    from engine.server.launcher import build_parser, engine_kwargs
    from engine.server.metrics import ServerMetrics

    ns = build_parser().parse_args(
        ["--model", "m", "--speculative", "ngram", "--num-speculative-tokens", "3"]
    )
    args = EngineArgs(model="m", **engine_kwargs(ns))
    assert args.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    default = EngineArgs(model="m", **engine_kwargs(build_parser().parse_args(["--model", "m"])))
    assert default.speculative_config == DEFAULT_SPECULATIVE_CONFIG
    off = build_parser().parse_args(["--model", "m", "--speculative", "none"])
    assert EngineArgs(model="m", **engine_kwargs(off)).speculative_config is None

    m = ServerMetrics("m")
    stats = EngineStats(
        spec_decode_num_drafts=4,
        spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=5,
        spec_decode_num_gated_steps=7,
        spec_decode_num_backoff_skips=3,
    )
    m.stats = lambda: stats
    text = generate_latest(m.registry).decode()
    assert 'fleet_engine_spec_decode_num_drafts_total{model="m"} 4.0' in text
    assert 'fleet_engine_spec_decode_num_draft_tokens_total{model="m"} 20.0' in text
    assert 'fleet_engine_spec_decode_num_accepted_tokens_total{model="m"} 5.0' in text
    assert 'fleet_engine_spec_decode_num_gated_steps_total{model="m"} 7.0' in text
    assert 'fleet_engine_spec_decode_num_backoff_skips_total{model="m"} 3.0' in text
    assert stats.spec_decode_acceptance_rate == 0.25


# -- the gate and the backoff ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_decoding", "limit", "want"),
    [
        (1, None, True),
        (64, None, True),
        (1, 4, True),
        (3, 4, True),
        (4, 4, False),
        (16, 4, False),
        (1, 1, False),
    ],
)
def test_batch_size_gate_table(num_decoding, limit, want):
    assert drafts_this_step(num_decoding, limit) is want


@pytest.mark.parametrize(
    ("streak", "want"), [(0, 0), (1, 0), (2, 1), (3, 2), (4, 4), (5, 8), (6, 16), (7, 16), (60, 16)]
)
def test_backoff_skip_table(streak, want):
    assert backoff_skip(streak) == want


def test_backoff_skips_grow_and_reset_on_an_accept():
    b = Backoff()
    drafted: list[bool] = []
    for accepted in [0, 0, 0, 0, 2, 0]:  # verify outcomes, each after a step that drafted
        while not b.should_draft():
            drafted.append(False)
        drafted.append(True)
        b.observe(accepted)
    # 2 zero verifies -> skip 1; one more -> skip 2; one more -> skip 4; an accept resets
    f = False
    assert drafted == [True, True, f, True, f, f, True, f, f, f, f, True, True]
    assert (b.zero_streak, b.skip_left) == (1, 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40))
def test_backoff_never_skips_right_after_an_accept_and_never_past_the_cap(outcomes):
    b = Backoff()
    for accepted in outcomes:
        b.observe(accepted)
        assert b.skip_left <= BACKOFF_MAX_SKIP
        if accepted:
            assert b.should_draft()


def _decoding(sched: Scheduler, n: int) -> list[Request]:
    """`n` requests past their prefill (one step), each with its first token appended."""
    reqs = [
        Request(f"r{i}", [1, 2, 1, 2, 1, 2, 1], SamplingParams(temperature=0.0), max_model_len=256)
        for i in range(n)
    ]
    for r in reqs:
        sched.add_request(r)
    sched.update_after_step(sched.schedule())
    for r in reqs:
        r.append_output_token(2)
    return reqs


def test_gate_keeps_a_large_batch_undrafted():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    reqs = _decoding(sched, 3)
    spec = SpeculativeDecoder(SpeculativeConfig(disable_by_batch_size=3), 256)
    spec.propose(sched.running)
    assert all(r.spec_token_ids == [] for r in reqs) and spec.num_gated_steps == 1
    open_gate = SpeculativeDecoder(SpeculativeConfig(disable_by_batch_size=4), 256)
    open_gate.propose(sched.running)
    assert all(r.spec_token_ids for r in reqs) and open_gate.num_gated_steps == 0


def test_rejected_sequences_back_off_in_the_decoder():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    (req,) = _decoding(sched, 1)
    spec = SpeculativeDecoder(SpeculativeConfig(prompt_lookup_min=1), 256)
    drafted = []
    for _ in range(5):
        spec.propose(sched.running)
        drafted.append(bool(req.spec_token_ids))
        if req.spec_token_ids:
            spec.after_verify(req, len(req.spec_token_ids), 0, kv)  # all rejected
    assert drafted == [True, True, False, True, False]
    assert spec.num_backoff_skips == 2
