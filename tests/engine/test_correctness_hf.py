"""Our engine against Hugging Face transformers on the real SmolLM2 GGUF, greedy.

Both run float32 on CPU from the same dequantized weights. Where the two token streams
diverge, the reference must have been at a near-tie (top-2 logit margin < 0.02) at that
step; any other divergence is a bug.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_PROMPTS = 16
NEW_TOKENS = 32
MAX_PROMPT_TOKENS = 384
NEAR_TIE = 0.02


@pytest.fixture(scope="module")
def prompts(shared_data, smollm2_gguf) -> list[list[int]]:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_gguf)
    rows = json.loads((shared_data / "sharegpt_v3_filtered_500.json").read_text())
    out: list[list[int]] = []
    for row in rows:
        turn = next((c["value"] for c in row["conversations"] if c["from"] == "human"), None)
        if not turn:
            continue
        ids = tok.encode_chat([{"role": "user", "content": turn}])
        if len(ids) <= MAX_PROMPT_TOKENS:
            out.append(ids)
        if len(out) == NUM_PROMPTS:
            break
    assert len(out) == NUM_PROMPTS
    return out


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm2):
    """HF's greedy choice and top-2 logit margin at every step of a stream, from one
    forward pass over the prompt and the stream (teacher forcing), memoized per stream.

    Up to the first step where the stream departs from HF's choice, its prefix is HF's own
    greedy run, so that step's choice and margin are those of HF's greedy loop: exactly
    what the comparison needs, at the cost of one prefill per distinct stream (every
    engine config usually yields the same streams) instead of a token-by-token decode.
    Raw logits, no `generate`: min_new_tokens would mask EOS and so disagree with an
    engine that ignores EOS but still lets the model pick it.
    """
    memo: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[list[int], list[float]]] = {}

    def score(prompt: list[int], stream: list[int]) -> tuple[list[int], list[float]]:
        key = (tuple(prompt), tuple(stream))
        if key not in memo:
            with torch.inference_mode():
                ids = torch.tensor([prompt + stream[:-1]])
                logits = hf_smollm2(ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
            top2 = torch.topk(logits, 2, dim=-1)
            memo[key] = (top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist())
        return memo[key]

    return score


def _compare(ours: list[list[int]], prompts: list[list[int]], hf_greedy) -> list[str]:
    problems = []
    for i, (got, prompt) in enumerate(zip(ours, prompts, strict=True)):
        assert len(got) == NEW_TOKENS, (i, len(got))
        want, margins = hf_greedy(prompt, got)
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is not None and margins[k] >= NEAR_TIE:
            problems.append(
                f"prompt {i}: diverged at step {k} (ours {got[k]}, HF {want[k]}) "
                f"where HF's top-2 margin was {margins[k]:.4f}"
            )
    return problems


# name -> (engine args, the prompts it runs). Prefix caching off runs one half of them: the
# same property on fewer prompts (the other configs run every prompt).
CONFIGS: dict[str, tuple[dict, slice]] = {
    "prefix-caching-on": (dict(enable_prefix_caching=True), slice(None)),
    "prefix-caching-off": (dict(enable_prefix_caching=False), slice(1, None, 2)),
    # 40 blocks of 16 tokens cannot hold 16 sequences of up to 416 tokens: forces preemption
    # (half the prompts do not: the scheduler then fits them without preempting).
    "preemption": (dict(enable_prefix_caching=True, num_gpu_blocks_override=40), slice(None)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name, prompts, hf_greedy, smollm2_gguf):
    engine_args, which = CONFIGS[name]
    prompts = prompts[which]
    llm = LLM("smollm2-135m", show_progress=False, max_num_seqs=16, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _compare([o.token_ids for o in outs], prompts, hf_greedy) == []
    stats = llm.stats()
    if name == "preemption":
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    if name == "prefix-caching-on":
        # A second pass over some prompts must hit the cache and still match.
        again = llm.generate(prompts[:4], params, use_tqdm=False)
        assert _compare([o.token_ids for o in again], prompts[:4], hf_greedy) == []
        assert all(o.num_cached_tokens > 0 for o in again)
        assert llm.stats().prefix_cache_hits > 0
    if name == "prefix-caching-off":
        assert stats.prefix_cache_hits == 0
