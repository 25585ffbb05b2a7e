"""The offline and async APIs on the real model: batching semantics, stops, seeds, aborts."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, SamplingParams
from engine.errors import PromptTooLongError
from tests.polling import eventually

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    return LLM("smollm2-135m", show_progress=False, max_num_seqs=32, max_model_len=1024)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_batch_equals_one_at_a_time(llm):
    prompts = [chat_ids(llm, q) for q in ("What is 2+2?", "Name a color.", "Write a haiku about rain.")]
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for o, p in zip(together, prompts):
        assert o.prompt_token_ids == p
        assert len(o.token_ids) == 12 or o.finish_reason == "stop"
        assert o.text == llm.tokenizer.decode(
            [t for t in o.token_ids if t not in llm.tokenizer.stop_token_ids]
        )


def test_string_prompt_and_params_list(llm):
    outs = llm.generate(
        ["The capital of France is", "1, 2, 3, 4,"],
        [SamplingParams(temperature=0.0, max_tokens=3), SamplingParams(temperature=0.0, max_tokens=5)],
        use_tqdm=False,
    )
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) == 5


def test_chat_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=200))[
        0
    ]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.tokenizer.stop_token_ids
    assert "<|im_end|>" not in out.text and out.text.strip()


def test_ignore_eos_runs_to_max_tokens(llm):
    out = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


def test_stop_string_is_cut_and_reported(llm):
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert "7" in base.text
    out = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop=["7"]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == "7"
    assert out.text == base.text[: base.text.index("7")]


def test_seed_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    q = chat_ids(llm, "Tell me a story.")
    alone = llm.generate([q], p, use_tqdm=False)[0].token_ids
    others = [chat_ids(llm, f"Question number {i}?") for i in range(5)]
    mixed = llm.generate(
        [*others[:2], q, *others[2:]],
        [SamplingParams(temperature=0.8, max_tokens=16)] * 2
        + [p]
        + [SamplingParams(temperature=0.8, max_tokens=16)] * 3,
        use_tqdm=False,
    )
    assert mixed[2].token_ids == alone


def test_n_gives_distinct_samples_sharing_the_prompt(llm):
    out = llm.generate(
        ["Once upon a time"], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_logprobs_match_tokens(llm):
    out = llm.generate(
        ["The sky is"], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.sampled.token_id == tok
        assert len(lp.top) == 3 and lp.top[0].token_id == tok  # greedy: the sampled one is the top one
        assert lp.sampled.logprob <= 0.0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
    assert "".join(lp.sampled.token for lp in out.logprobs) == out.text


def test_prompt_too_long_is_refused(llm):
    with pytest.raises(PromptTooLongError) as err:
        llm.generate([[1] * 1000], SamplingParams(max_tokens=100), use_tqdm=False)
    assert "1024" in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_bad_token_ids_are_refused(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 10**9]], GREEDY, use_tqdm=False)


def test_priorities_order_admission(smollm2_gguf):
    llm = LLM("smollm2-135m", show_progress=False, max_num_seqs=1)
    outs = llm.generate(
        ["a", "b", "c"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False, priority=[2, 0, 1]
    )
    starts = [o.metrics.first_scheduled_time for o in outs]
    assert starts[1] < starts[2] < starts[0]


async def test_async_streams_and_abort_frees_blocks(smollm2_gguf):
    engine = AsyncLLM("smollm2-135m", show_progress=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16)
        chunks, final = [], None
        async for out in engine.generate("Count: one, two,", params, "s1"):
            chunks.append(out.outputs[0].delta_text)
            final = out
        assert final is not None and final.finished
        assert "".join(chunks) == final.outputs[0].text

        async def consume_two():
            n = 0
            async for _ in engine.generate(
                "Write a long essay.", SamplingParams(max_tokens=500, ignore_eos=True), "s2"
            ):
                n += 1
                if n == 2:
                    break  # dropping the stream aborts the request

        await consume_two()
        await eventually(
            lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0,
            30,
            "the aborted request's blocks freed",
            0.02,
        )
        assert engine.stats().num_running == 0
        assert engine.stats().kv_cache_usage == 0.0

        # Many concurrent streams all finish.
        async def one(i):
            last = None
            async for out in engine.generate(
                f"Question {i}:", SamplingParams(temperature=0.0, max_tokens=4), f"c{i}"
            ):
                last = out
            return last

        results = await asyncio.gather(*(one(i) for i in range(12)))
        assert all(r.finished and len(r.token_ids) >= 1 for r in results)
    finally:
        engine.shutdown()
