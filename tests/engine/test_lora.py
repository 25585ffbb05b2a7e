"""Multi-LoRA in the engine against Hugging Face transformers + PEFT, float32, greedy.

Two random adapters (ranks 8 and 4, attention-only and MLP+q targets, non-zero B) over a
tiny random Llama: each alone, and all mixed in one batch with the base model, give PEFT's
tokens. Also: prefix-cache isolation between adapters, the slot LRU with fewer slots than
adapters, CPU eviction and re-reading, and adapters that do not fit the base are refused.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora import LoRAAdapterError
from engine.server.protocol_metrics import LORA_INFO, protocol_families
from tests.engine.lora_fixtures import ADAPTERS, make_adapter, make_tiny_base

# find_spec, not importorskip: importing peft at collection loads triton in compiled mode,
# which would keep the kernel tests from running in this process's Triton interpreter.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")

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


def test_adapters_that_do_not_fit_are_refused_and_change_nothing(files, llm, tmp_path):
    from engine.lora import LoRAManager

    _, paths = files
    manager = LoRAManager(
        llm.model_config, max_loras=1, max_rank=4, max_cpu_loras=None, dtype=torch.float32, device="cpu"
    )
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


# -- the server: vLLM's LoRA API on a real replica ------------------------------------------


@pytest.fixture(scope="module")
def replica(files, tmp_path_factory):
    from engine.server.process import ServerProcess

    base, paths = files
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    first = next(iter(ADAPTERS))
    proc = ServerProcess(
        "--served-model-name", "tiny", "--max-loras", "2", "--lora-modules", f"{first}={paths[first]}",
        model=str(base), log_path=log,
    )  # fmt: skip
    with proc:
        yield proc


def test_server_lora_api_matches_peft_mixed_and_concurrent(replica, files, reference):
    import asyncio

    import httpx
    import openai

    from engine.tokenizer import Tokenizer

    base, paths = files
    first, second = list(ADAPTERS)
    tok = Tokenizer.from_path(base)
    with httpx.Client(base_url=replica.url, timeout=60) as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), (first, "tiny")]
        # Loaded at run time; refused loads (taken name, bad path, rank too large) change nothing.
        r = http.post("/v1/load_lora_adapter", json={"lora_name": second, "lora_path": str(paths[second])})
        assert r.status_code == 200, r.text
        for bad in (
            {"lora_name": second, "lora_path": str(paths[second])},
            {"lora_name": "tiny", "lora_path": str(paths[second])},
            {"lora_name": "x", "lora_path": str(base / "nowhere")},
            {"lora_name": "x", "lora_path": str(base)},
            {"lora_name": "x"},
        ):
            r = http.post("/v1/load_lora_adapter", json=bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["message"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", first, second]

    async def complete(client, name, i):
        r = await client.completions.create(
            model=name or "tiny", prompt=PROMPTS[i], max_tokens=NEW_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.model == (name or "tiny")
        return r.choices[0].text

    async def mixed():
        async with openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="x") as client:
            jobs = [(n, i) for n in (None, first, second) for i in range(len(PROMPTS))]
            texts = await asyncio.gather(*(complete(client, n, i) for n, i in jobs))
            return jobs, texts

    jobs, texts = asyncio.run(mixed())
    compared = 0
    for (name, i), text in zip(jobs, texts):
        tokens, margins = reference[name, i]
        if min(margins) >= NEAR_TIE:  # no near-tie anywhere: the text must be PEFT's exactly
            assert text == tok.decode(tokens, skip_special_tokens=True), (name, i)
            compared += 1
    assert compared >= len(jobs) - 2, f"only {compared} of {len(jobs)} completions were comparable"

    with httpx.Client(base_url=replica.url, timeout=60) as http:
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": second})
        assert r.status_code == 200, r.text
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", first]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": second}).status_code == 404
        gone = http.post("/v1/completions", json={"model": second, "prompt": "Hi", "max_tokens": 1})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert "fleet_engine_lora_requests_total" in http.get("/metrics").text


def test_stats_name_the_adapters_of_running_and_waiting_requests(files):
    """What llm-d's `vllm:lora_requests_info` labels read: one adapter slot, two adapters asked
    for, so one adapter's request runs and the other's waits (the base
    request behind it waits too: admission is in order)."""
    base, paths = files
    engine = LLM(str(base), enable_lora=True, max_loras=1, show_progress=False)
    for name, path in paths.items():
        engine.add_lora(name, str(path))
    first, second = ADAPTERS
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name in (first, second, None):
        engine.engine.add_request(PROMPTS[0], p, lora_name=name)
    s = engine.engine.stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters, s.max_loras) == (
        (),
        tuple(sorted((first, second))),
        1,
    )
    engine.engine.step()
    s = engine.engine.stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters, s.num_running) == ((first,), (second,), 1)
    [info] = [m for m in protocol_families(s, "base") if m.name == LORA_INFO]
    assert info.samples[0].labels == {
        "running_lora_adapters": first,
        "waiting_lora_adapters": second,
        "max_lora": "1",
    }
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    assert engine.engine.stats().running_lora_adapters == ()
