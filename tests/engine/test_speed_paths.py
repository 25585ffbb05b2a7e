"""Thread policy, weight formats and the step profiler: cheap, no real model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.weights import FORMATS, column_major, convert_linears
from engine.threads import ThreadPolicy, ThreadTuner, available_cpus


def test_available_cpus_is_within_the_affinity_mask() -> None:
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def _drive(policy: ThreadPolicy, cost: dict[int, float], steps: int) -> list[int]:
    used = []
    for _ in range(steps):
        n = policy.next_threads(10)
        policy.record(n, cost[n] * 10, 10)
        used.append(n)
    return used


def test_policy_probes_every_candidate_then_keeps_the_fastest() -> None:
    policy = ThreadPolicy(max_threads=4, probe_every=20, probe_steps=2)
    assert policy.candidates == [4, 2, 1]
    used = _drive(policy, {4: 3.0, 2: 1.0, 1: 2.0}, 20)
    assert set(used[:6]) == {4, 2, 1}
    assert used[6:] == [2] * 14


def test_policy_follows_a_change_of_load() -> None:
    policy = ThreadPolicy(max_threads=2, probe_every=10, probe_steps=2)
    _drive(policy, {2: 1.0, 1: 1.8}, 10)
    assert policy.best(10) == 2
    used = _drive(policy, {2: 5.0, 1: 1.8}, 30)  # another process takes a core
    assert policy.best(10) == 1 and used[-5:] == [1] * 5


def test_policy_keeps_prefill_and_decode_estimates_apart() -> None:
    policy = ThreadPolicy(max_threads=2, probe_every=100, probe_steps=1)
    for _ in range(4):  # decodes: 1 thread wins; big prefills: 2 threads win
        for tokens, cost in ((4, {2: 3.0, 1: 1.0}), (2048, {2: 0.01, 1: 0.02})):
            n = policy.next_threads(tokens)
            policy.record(n, cost[n] * tokens, tokens)
    assert policy.best(4) == 1 and policy.best(2048) == 2


def test_tuner_sets_threads_only_on_change() -> None:
    calls: list[int] = []
    tuner = ThreadTuner(ThreadPolicy(max_threads=1), calls.append)
    for _ in range(3):
        tuner.before_step(1)
        tuner.after_step(0.01, 1)
    assert calls == [1]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 128, bias=False))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_formats_match_fp32_within_their_precision(fmt: str) -> None:
    torch.manual_seed(0)
    model = _Tiny()
    x = torch.randn(5, 128)
    ref = model(x)
    assert convert_linears(model, fmt) == (0 if fmt == "fp32" else 2)
    out = model(x)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel < {"fp32": 1e-7, "fp16": 2e-3, "bf16": 2e-2, "int8": 4e-2, "int4": 0.2}[fmt]


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 128)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 128, bias=False))])
        self.lm_head = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.layers[0](self.embed_tokens(ids)), self.embed_tokens.weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_column_major_weights_keep_values_and_every_format_still_converts(fmt: str) -> None:
    torch.manual_seed(1)
    model = _TiedLM()
    ids = torch.tensor([3, 0, 49, 7])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.inference_mode():
        ref = model(ids)
        assert column_major(model) == 3  # two linears and the tied embedding
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert not model.layers[0][0].weight.is_contiguous()
        assert model.layers[0][0].weight.t().is_contiguous()
        assert torch.allclose(model(ids), ref, rtol=1e-5, atol=1e-6)
        assert column_major(model) == 0  # already column-major: nothing to do
        convert_linears(model, fmt)
        out = model(ids)
    assert ((out - ref).norm() / ref.norm()).item() < {
        "fp32": 1e-6,
        "fp16": 2e-3,
        "bf16": 2e-2,
        "int8": 4e-2,
        "int4": 0.2,
    }[fmt]


def test_unknown_weight_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown weight format"):
        convert_linears(_Tiny(), "int3")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    import json

    from engine.model_files.aliases import resolve_model_path
    from engine.tokenizer import Tokenizer
    from tests.engine.tiny_checkpoints import make_tiny_hf_checkpoint

    out = tmp_path_factory.mktemp("tiny_speed")
    tok = Tokenizer.from_path(resolve_model_path("smollm2-135m"))
    make_tiny_hf_checkpoint(
        out, vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256, num_layers=2, seed=5
    )
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    return out


def test_profiler_splits_live_steps_and_weight_formats_serve(tiny_model_dir) -> None:
    from engine import LLM, SamplingParams
    from engine.profiling import STAGES, StepProfiler

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there, how are", "1 2 3 4 5 6 7 8 9"]
    outs = {}
    for fmt in ("fp32", "fp16", "int8", "auto"):
        llm = LLM(str(tiny_model_dir), weights=fmt, show_progress=False, max_model_len=128)
        chosen = llm.engine.runner.weights
        assert chosen == fmt
        prof = StepProfiler(llm.engine).attach()
        outs[fmt] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        prof.detach()
        ms = prof.per_step_ms()
        assert prof.steps >= 8 and ms["total"] > 0
        assert sum(ms[s] for s in STAGES) == pytest.approx(ms["total"], rel=0.05)
        assert ms["mlp"] > 0 and ms["attention"] > 0 and ms["sampling"] > 0
        assert "step" not in llm.engine.__dict__  # detached: the engine's own method again
        model = llm.engine.runner.model
        assert all("forward" not in m.__dict__ for m in model.modules())  # plain methods again
    assert all(len(t) == 8 for t in outs["fp16"] + outs["int8"] + outs["auto"])


def test_server_flags_reach_the_engine_args() -> None:
    from engine.config import EngineArgs
    from engine.server.launcher import build_parser, engine_kwargs

    ns = build_parser().parse_args(["--model", "m", "--weights", "int8", "--threads", "1"])
    args = EngineArgs(model="m", **engine_kwargs(ns))
    assert (args.weights, args.num_threads, args.cuda_graphs) == ("int8", 1, False)
    assert (
        EngineArgs(model="m", **engine_kwargs(build_parser().parse_args(["--model", "m"]))).num_threads
        is None
    )
