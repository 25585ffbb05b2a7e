"""Batched sampler: each stage against a naive reference, statistics, and seed isolation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from engine.sampler import Sampler, SamplingBatch
from fleet_base.sampling_params import SamplingParams as SP


def chi2_999(dof: int) -> float:
    """99.9% quantile of chi-square (Wilson-Hilferty; within 2% for dof >= 1)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + 3.09 * math.sqrt(a)) ** 3


def build(
    params: Sequence[SP],
    vocab: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    stops: Sequence[set[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    if generators is None:
        generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return SamplingBatch.build(
        params=list(params),
        prompt_token_ids=list(prompts) if prompts is not None else [[] for _ in range(n)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(n)],
        generators=list(generators),
        stop_token_ids=list(stops) if stops is not None else [set() for _ in range(n)],
        vocab_size=vocab,
        device=torch.device("cpu"),
    )


def sample(logits: torch.Tensor, params: Sequence[SP], sampler: Sampler | None = None, **kw) -> list[int]:
    return (sampler or Sampler())(logits, build(params, logits.shape[1], **kw)).token_ids


def chi2(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the tokens with non-zero probability; fails on impossible tokens."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token that should be impossible"
    expected = probs[support].double() * len(tokens)
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def assert_matches(tokens: list[int], probs: torch.Tensor) -> None:
    stat, dof = chi2(tokens, probs)  # dof 0: a single possible token, already checked
    assert dof == 0 or stat < chi2_999(dof), f"chi2={stat:.1f} with {dof} dof"


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(1234)


LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N_STAT = 4000


# --- greedy ---------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, 300)
    batch = build([SP(temperature=0)] * 6, 300)
    assert batch.fast_greedy
    assert Sampler()(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_greedy_ties_take_lowest_index_on_both_paths() -> None:
    logits = torch.zeros(2, 50)
    logits[:, 7] = logits[:, 31] = 5.0
    assert sample(logits, [SP(temperature=0)] * 2) == [7, 7]
    # Penalty path (penalizing an unrelated token) must break ties the same way.
    pen = SP(temperature=0, presence_penalty=1.0)
    assert sample(logits, [pen, pen], outputs=[[3], [3]]) == [7, 7]


# --- temperature / truncation statistics ------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = LOGITS8.expand(N_STAT, -1)
    tokens = sample(logits, [SP(temperature=temperature)] * N_STAT)
    assert_matches(tokens, torch.softmax(LOGITS8 / temperature, -1))


def test_seeded_rows_match_softmax() -> None:
    logits = LOGITS8.expand(2000, -1)
    tokens = sample(logits, [SP(temperature=1.0, seed=s) for s in range(2000)])
    assert_matches(tokens, torch.softmax(LOGITS8, -1))


def expected_truncated(
    logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Naive per-row reference: a Python loop over sorted tokens."""
    probs = torch.softmax(logits.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        nucleus.append(i)
        acc += probs[i] / mass
        if acc >= top_p:
            break
    top = max(probs[i] for i in nucleus)
    final = [i for i in nucleus if probs[i] >= min_p * top]
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in final:
        out[i] = probs[i]
    return out / out.sum()


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(4, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.3), (4, 0.75, 0.0), (6, 0.95, 0.2)],
)
@pytest.mark.parametrize("num_candidates", [256, 2])  # 2 forces the full-sort fallback
def test_truncation_matches_reference(top_k: int, top_p: float, min_p: float, num_candidates: int) -> None:
    logits = LOGITS8.expand(N_STAT, -1)
    params = [SP(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p)] * N_STAT
    tokens = sample(logits, params, sampler=Sampler(num_candidates=num_candidates))
    assert_matches(tokens, expected_truncated(LOGITS8 / 0.9, top_k, top_p, min_p))


def test_min_p_filters_relative_to_max() -> None:
    probs = torch.tensor([0.4, 0.3, 0.13, 0.12, 0.05])
    logits = probs.log().expand(N_STAT, -1)
    tokens = sample(logits, [SP(temperature=1.0, min_p=0.3)] * N_STAT)  # keeps p >= 0.12
    assert set(tokens) == {0, 1, 2, 3}
    assert_matches(tokens, torch.tensor([0.4, 0.3, 0.13, 0.12, 0.0]) / 0.95)


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = torch.randn(16, 500) * 2
    outputs = [[int(t) for t in torch.randint(0, 500, (5,))] for _ in range(16)]
    greedy = sample(logits, [SP(temperature=0, repetition_penalty=1.5)] * 16, outputs=outputs)
    for p in (SP(temperature=1.3, top_k=1), SP(temperature=0.7, top_p=1e-6)):
        pen = p.model_copy(update={"repetition_penalty": 1.5})
        assert sample(logits, [pen] * 16, outputs=outputs) == greedy
        assert sample(logits, [pen] * 16, outputs=outputs, sampler=Sampler(num_candidates=1)) == greedy


def test_top_k_wider_than_candidates_is_exact() -> None:
    vocab = 64
    logits = torch.linspace(3, -3, vocab).expand(N_STAT, -1)  # the candidate pass widens to top_k
    tokens = sample(logits, [SP(temperature=1.0, top_k=6)] * N_STAT, sampler=Sampler(num_candidates=4))
    assert_matches(tokens, expected_truncated(logits[0], top_k=6))


def test_undecided_rows_widen_until_decided() -> None:
    # Nuclei of 1, 8 and 47 tokens: decided by 2 candidates, by 32, and by the full sort.
    logits = torch.linspace(3, -3, 64)
    groups = [0.05, 0.5, 0.99]
    params = [SP(temperature=1.0, top_p=groups[r % 3]) for r in range(3 * 1500)]
    tokens = sample(logits.expand(len(params), -1), params, sampler=Sampler(num_candidates=2))
    for g, top_p in enumerate(groups):
        want = expected_truncated(logits, top_p=top_p)
        assert int((want > 0).sum()) == [1, 8, 47][g]
        assert_matches(tokens[g::3], want)


# --- penalties ----------------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, params: Sequence[SP], prompts, outputs) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(params):
        for tok in set(prompts[r]) | set(outputs[r]):
            v = out[r, tok].item()
            out[r, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(outputs[r]):
            count = outputs[r].count(tok)
            out[r, tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_naive_reference() -> None:
    vocab = 40
    logits = torch.randn(7, vocab) * 3
    params = [
        SP(repetition_penalty=1.7),
        SP(frequency_penalty=0.5),
        SP(presence_penalty=-1.2),
        SP(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.9, temperature=0),
        SP(),  # no penalty: untouched even though it shares the batch
        SP(repetition_penalty=1.5, presence_penalty=2.0),  # first step: no outputs yet
        SP(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=2.0),  # nothing seen at all
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9], [10, 11], [0, 18], []]
    outputs = [[2, 5, 5], [12, 12, 12, 13], [6, 14, 14], [8, 15, 15, 16], [17], [], []]
    batch = build(params, vocab, prompts=prompts, outputs=outputs)
    got = Sampler.adjusted_logits(logits, batch)
    want = reference_penalties(logits, params, prompts, outputs)
    assert (got - want).abs().max().item() < 1e-6  # (torch.testing costs 2 s to import)
    assert torch.equal(got[4], logits[4]) and torch.equal(got[6], logits[6])
    assert (got[5] != logits[5]).nonzero().flatten().tolist() == [0, 18]
    # Frequency penalty on row 1 changed exactly the output tokens, by 0.5 per occurrence.
    changed = (got[1] != logits[1]).nonzero().flatten().tolist()
    assert changed == [12, 13]
    assert got[1, 12].item() == pytest.approx(logits[1, 12].item() - 1.5)


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert sample(logits, [SP(temperature=0)]) == [1]
    assert sample(logits, [SP(temperature=0, repetition_penalty=1.1)], outputs=[[1]]) == [2]
    assert sample(logits, [SP(temperature=0, presence_penalty=0.2)], outputs=[[1]]) == [2]


# --- min_tokens ---------------------------------------------------------------------


def test_min_tokens_blocks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.5]]).expand(200, -1)
    stops = [{2, 3}] * 200
    params = [SP(temperature=0, min_tokens=3)] * 100 + [SP(temperature=1.0, min_tokens=3)] * 100
    early = sample(logits, params, outputs=[[1, 1]] * 200, stops=stops)
    assert set(early[:100]) == {1} and set(early[100:]) <= {0, 1}
    late = sample(logits, params, outputs=[[1, 1, 1]] * 200, stops=stops)
    assert set(late[:100]) == {2} and set(late[100:]) & {2, 3}


# --- seeds ----------------------------------------------------------------------------


def step_logits(request: int, step: int, vocab: int) -> torch.Tensor:
    """Deterministic, peaked logits for one request at one step."""
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(vocab, generator=g) * 3


def random_params(n: int, g: torch.Generator) -> list[SP]:
    choices = [
        SP(temperature=0),
        SP(temperature=0.8, top_p=0.9),
        SP(temperature=1.2, top_k=3000),  # beyond the candidates: widens the top-k pass
        SP(temperature=1.0, min_p=0.05, presence_penalty=0.5),
        SP(temperature=0.7, seed=99, repetition_penalty=1.3, logprobs=2),
        SP(temperature=1.0),
    ]
    return [choices[int(i)] for i in torch.randint(0, len(choices), (n,), generator=g)]


@pytest.mark.parametrize(
    "target",
    [
        SP(temperature=0.9, top_p=0.95, top_k=50, seed=7, repetition_penalty=1.2),
        SP(temperature=1.0, seed=11, min_tokens=2),
        SP(temperature=1.5, top_p=0.999, seed=5),
    ],
)
def test_seeded_request_independent_of_batch(target: SP) -> None:
    vocab, steps = 4096, 4
    g = torch.Generator().manual_seed(3)
    alone = run_steps_at([target], 0, vocab, steps, Sampler())
    for position in (0, 5):
        others = random_params(8, g)
        mixed = [*others[:position], target, *others[position:]]
        got = run_steps_at(mixed, position, vocab, steps, Sampler())
        assert got == alone, f"position {position}"
    # The candidate path and the full-sort fallback agree too.
    assert run_steps_at([target], 0, vocab, steps, Sampler(num_candidates=1)) == alone


def run_steps_at(params: list[SP], position: int, vocab: int, steps: int, sampler: Sampler) -> list[int]:
    """Decode `steps` tokens for every row; the row at `position` is request 0 (its logits,
    prompt and tokens), the others get their own. Returns request 0's tokens."""
    ids = [0 if r == position else r + 100 for r in range(len(params))]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    prompts = [[i, i + 1, 7] for i in ids]
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        logits = torch.stack([step_logits(i, step, vocab) for i in ids])
        batch = build(
            params, vocab, prompts=prompts, outputs=outputs, generators=gens, stops=[{0}] * len(params)
        )
        for r, t in enumerate(sampler(logits, batch).token_ids):
            outputs[r].append(t)
    return outputs[position]


def test_seed_without_generator_is_rejected() -> None:
    with pytest.raises(ValueError, match="seed"):
        build([SP(seed=1)], 10, generators=[None])


# --- logprobs -------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    vocab = 100
    logits = torch.randn(4, vocab) * 2
    params = [
        SP(temperature=0.5, logprobs=5, repetition_penalty=2.0),
        SP(temperature=0, logprobs=0),
        SP(temperature=1.0),
        SP(temperature=1.0, top_k=3, logprobs=20),
    ]
    out = Sampler()(logits, build(params, vocab, outputs=[[1, 2]] * 4))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[row]
        assert lp is not None
        assert lp.sampled.token_id == out.token_ids[row]
        assert lp.sampled.logprob == pytest.approx(ref[row, out.token_ids[row]].item(), abs=1e-5)
        assert len(lp.top) == k
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True)
        assert [t.token_id for t in lp.top] == ref[row].topk(k).indices.tolist()
        for t in lp.top:
            assert t.logprob == pytest.approx(ref[row, t.token_id].item(), abs=1e-5)
            assert t.token == ""


def test_no_logprobs_when_nobody_asks() -> None:
    assert Sampler()(torch.randn(2, 10), build([SP(), SP(temperature=0)], 10)).logprobs is None


# --- mixed batches / contract -----------------------------------------------------------


def test_mixed_batch_rows_equal_alone() -> None:
    vocab = 2000
    params = [
        SP(temperature=0),
        SP(temperature=0.8, seed=1, top_p=0.9, logprobs=3),
        SP(temperature=0, frequency_penalty=1.5, logprobs=0),
        SP(temperature=1.1, seed=2, top_k=20, presence_penalty=1.0, repetition_penalty=1.3),
        SP(temperature=1.0, min_p=0.1),  # unseeded: only checked for validity
        SP(temperature=0.6, seed=3, min_tokens=5),
        SP(temperature=0, repetition_penalty=3.0, min_tokens=5, logprobs=4),
    ]
    n = len(params)
    logits = torch.randn(n, vocab) * 4
    prompts = [[int(t) for t in logits[r].topk(3).indices] for r in range(n)]  # penalize likely tokens
    outputs = [[int(logits[r].argmax()), 5, 5] for r in range(n)]
    stops = [{int(logits[r].topk(2).indices[1])} for r in range(n)]
    before = logits.clone()
    mixed = Sampler()(logits, build(params, vocab, prompts=prompts, outputs=outputs, stops=stops))
    assert torch.equal(logits, before), "the sampler must not modify its input"
    for r in range(n):
        if params[r].seed is None and not params[r].greedy:
            continue
        alone = Sampler()(
            logits[r : r + 1],
            build([params[r]], vocab, prompts=[prompts[r]], outputs=[outputs[r]], stops=[stops[r]]),
        )
        assert mixed.token_ids[r] == alone.token_ids[0], f"row {r}"
        assert mixed.logprobs is not None
        assert mixed.logprobs[r] == (alone.logprobs or [None])[0], f"row {r}"
    # The unseeded min-p row still respects its filter.
    probs = torch.softmax(logits[4], -1)
    assert probs[mixed.token_ids[4]] >= 0.1 * probs.max()
    # Stop ids of min_tokens rows were blocked.
    assert mixed.token_ids[6] not in stops[6]


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(3, 12)
    logits[:, 10:] = 50.0  # padding columns beyond vocab_size=10
    params = [SP(temperature=0), SP(temperature=1.0), SP(temperature=1.0, top_p=0.5)]
    out = Sampler()(logits, build(params, 10))
    assert all(t < 10 for t in out.token_ids)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.randn(3, 10), build([SP()] * 2, 10))


def test_blocking_all_but_one_token_forces_it() -> None:
    # Stop ids cover everything but token 4: sampled rows can only pick 4.
    vocab = 6
    logits = torch.randn(50, vocab)
    stops = [set(range(vocab)) - {4}] * 50
    params = [SP(temperature=1.5, min_tokens=1)] * 50
    assert set(sample(logits, params, stops=stops)) == {4}
