"""Speculative decoding on the real model: outputs with n-gram drafts equal those without.

Greedy token for token on prompts whose outputs repeat (drafts are accepted), seeded
sampling token for token (each row draws the noise of its output index), logprobs, stop
strings and max_tokens, in one batch whose steps use both verification layouts."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,  # both verification layouts, whatever the default gate
}


@pytest.fixture(scope="module")
def engines(smollm2_gguf) -> tuple[LLM, LLM]:
    kw = {"show_progress": False, "max_num_seqs": 8, "max_model_len": 512, "kv_cache_memory": 64 << 20}
    off = LLM("smollm2-135m", speculative_config=None, **kw)
    return off, LLM("smollm2-135m", speculative_config=SPEC, **kw)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_greedy_and_seeded_outputs_are_unchanged(engines):
    off, on = engines
    counting = off.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,", add_special_tokens=True)
    prompts = [
        counting,
        _chat(off, "Copy this list: apples, pears, plums, cherries, grapes, lemons, limes."),
        counting,
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, stop=["cherries"]),
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True),
    ]
    # Three sequences: steps where all three verify lay them out as decode rows, steps
    # with one or two (the copy stops early) as prefill chunks.
    want = off.generate(prompts, params, use_tqdm=False)
    got = on.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert len(got[0].token_ids) == len(got[2].token_ids) == 16
    lps = got[0].outputs[0].logprobs
    assert [lp.sampled.token_id for lp in lps] == got[0].token_ids
    for a, b in zip(lps, want[0].outputs[0].logprobs, strict=True):
        assert a.sampled.logprob == pytest.approx(b.sampled.logprob, abs=1e-3)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    if want[1].finish_reason == "stop":
        assert "cherries" not in got[1].text
    stats = on.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0  # the counting prompt repeats itself
    assert off.stats().spec_decode_num_draft_tokens == 0


def test_bench_measures_both_engines(engines):
    """bench.spec_decode's pieces on tiny sizes: a copy case, and one run per engine."""
    from bench import spec_decode

    off, on = engines
    assert all(s.lstrip().startswith("def ") for s in spec_decode.code_snippets(3))
    case = spec_decode.Case(
        prompts=[_chat(off, "Repeat: a b c d e f a b c d e f")], max_tokens=[4], ignore_eos=True
    )
    runs = [spec_decode.run(llm, case, 1, "copy", arm) for llm, arm in ((off, "off"), (on, "ngram"))]
    assert [r.tokens for r in runs] == [4, 4] and runs[0].outputs == runs[1].outputs
    assert runs[0].drafted == 0 and runs[1].drafted > 0
