"""Multi-LoRA in the engine against Hugging Face transformers + PEFT, float32, greedy.

Two random adapters (ranks 8 and 4, attention-only and MLP+q targets, non-zero B) over a
tiny random Llama: each alone, and all mixed in one batch with the base model, give PEFT's
tokens. Also: prefix-cache isolation between adapters, the slot LRU with fewer slots than
adapters, CPU eviction and re-reading, and adapters that do not fit the base are refused.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora import LoRAAdapterError
from tests.engine.lora_fixtures import ADAPTERS, make_adapter, make_tiny_base

pytest.importorskip("peft")

NEW_TOKENS = 8
NEAR_TIE = 1e-3
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs",
    "Hello",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_base(root / "base")
    paths = {name: make_adapter(root / name, base, *spec) for name, spec in ADAPTERS.items()}
    return base, paths


@pytest.fixture(scope="module")
def reference(files):
    """PEFT's greedy tokens and top-2 margins for every (adapter or None, prompt)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from engine.tokenizer import Tokenizer

    base, paths = files
    tok = Tokenizer.from_path(base)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = list(paths)
    peft = PeftModel.from_pretrained(model, paths[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(paths[name], adapter_name=name)

    def greedy(ids):
        tokens, margins = [], []
        res = peft(torch.tensor([ids]), use_cache=True)
        for _ in range(NEW_TOKENS):
            top2 = torch.topk(res.logits[0, -1].float(), 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            res = peft(torch.tensor([[tokens[-1]]]), past_key_values=res.past_key_values, use_cache=True)
        return tokens, margins

    out = {}
    with torch.inference_mode():
        for name in [None, *names]:
            for i, prompt in enumerate(PROMPTS):
                ids = tok.encode(prompt, add_special_tokens=True)
                if name is None:
                    with peft.disable_adapter():
                        out[None, i] = greedy(ids)
                else:
                    peft.set_adapter(name)
                    out[name, i] = greedy(ids)
    return out


@pytest.fixture(scope="module")
def llm(files):
    base, paths = files
    engine = LLM(str(base), enable_lora=True, max_loras=2, show_progress=False, block_size=16)
    for name, path in paths.items():
        engine.add_lora(name, str(path))
    return engine


def _check(got: list[int], want: tuple[list[int], list[float]], label: str) -> None:
    tokens, margins = want
    k = next((j for j, (a, b) in enumerate(zip(got, tokens)) if a != b), None)
    assert k is None or margins[k] < NEAR_TIE, f"{label}: diverged at {k}: ours {got}, PEFT {tokens}"


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_each_adapter_alone_matches_peft(llm, reference):
    base_tokens = None
    for name in [None, *ADAPTERS]:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora=name)
        got = [o.outputs[0].token_ids for o in outs]
        for i, tokens in enumerate(got):
            _check(tokens, reference[name, i], f"{name} prompt {i}")
        if name is None:
            base_tokens = got
        else:
            assert got != base_tokens, f"adapter {name} changed nothing"


def test_mixed_batch_of_base_and_two_adapters_matches_peft(llm, reference):
    names = [None, *ADAPTERS]
    jobs = [(names[k % 3], i) for k in range(3) for i in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[i] for _, i in jobs], PARAMS, use_tqdm=False, lora=[n for n, _ in jobs])
    for (name, i), out in zip(jobs, outs):
        _check(out.outputs[0].token_ids, reference[name, i], f"mixed {name} prompt {i}")


def test_prefix_cache_never_crosses_adapters(llm):
    prompt = PROMPTS[0] * 3  # several full blocks
    p = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.generate(prompt, p, use_tqdm=False)[0].num_cached_tokens == 0
    name = next(iter(ADAPTERS))
    assert llm.generate(prompt, p, use_tqdm=False, lora=name)[0].num_cached_tokens == 0
    assert llm.generate(prompt, p, use_tqdm=False, lora=name)[0].num_cached_tokens > 0


def test_one_slot_lru_and_cpu_eviction_stay_correct(files, reference):
    base, paths = files
    engine = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, show_progress=False)
    for name, path in paths.items():
        engine.add_lora(name, str(path))
    manager = engine.engine.lora
    assert manager is not None
    names = [None, *ADAPTERS, None, *ADAPTERS]
    outs = engine.generate([PROMPTS[0]] * len(names), PARAMS, use_tqdm=False, lora=names)
    for name, out in zip(names, outs):
        _check(out.outputs[0].token_ids, reference[name, 0], f"lru {name}")
    # One slot for two adapters: they took turns; one CPU copy: the other was re-read from disk.
    assert manager.slot_loads_total >= 2
    assert sum(a.weights is not None for a in manager.list()) == 1


def test_adapters_that_do_not_fit_are_refused_and_change_nothing(files, tmp_path):
    base, paths = files
    engine = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=4, show_progress=False)
    manager = engine.engine.lora
    assert manager is not None
    with pytest.raises(LoRAAdapterError, match="exceeds"):
        manager.add("big", paths["attn8"])  # rank 8 > max_lora_rank 4
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        manager.add("nowhere", tmp_path / "missing")
    other = make_tiny_base(tmp_path / "other", hidden_size=64)
    wrong = make_adapter(tmp_path / "wrong", other, 4, 8, ["q_proj"], 5)
    with pytest.raises(LoRAAdapterError, match="shape"):
        manager.add("wrong", wrong)
    odd = tmp_path / "odd"
    shutil.copytree(paths["mlp4"], odd)
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    with pytest.raises(LoRAAdapterError, match="not adaptable"):
        manager.add("odd", odd)
    manager.add("mlp4", paths["mlp4"])
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        manager.add("mlp4", paths["mlp4"])
    assert [a.name for a in manager.list()] == ["mlp4"]
