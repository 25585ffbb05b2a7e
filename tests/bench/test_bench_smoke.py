"""Keeps the benchmark scripts from rotting: their core functions on tiny sizes.

The transformers baselines run on a tiny random Llama (no 20 s GGUF load); the engine parts
run on the real model and are marked slow.
"""

from __future__ import annotations

import gc
import json
import mmap
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from bench import common, engine_throughput, inputs, kv_offload, long_prefill, prefix_cache
from bench.engine_throughput import SystemResult, Workload
from tests.polling import wait_for


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny sizes gain nothing from threads, and on a busy 2-core box they lose a lot."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


TINY_WORKLOAD = Workload(
    prompts=[[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]], output_lens=[3, 6, 2, 4]
)


def test_hf_single_counts_each_requests_own_tokens(tiny_llama: Any) -> None:
    res = engine_throughput.run_hf_single(tiny_llama, TINY_WORKLOAD, limit=2, pad_id=0)
    assert res.num_requests == 2
    assert res.output_tokens == 3 + 6
    assert res.prompt_tokens == 5 + 2
    assert res.seconds > 0 and res.tokens_per_s > 0
    assert "first 2 of 4" in res.note


def test_hf_static_counts_useful_tokens_not_padding(tiny_llama: Any) -> None:
    res = engine_throughput.run_hf_static(tiny_llama, TINY_WORKLOAD, batch_size=3, pad_id=0)
    assert res.output_tokens == 3 + 6 + 2 + 4
    # Batch 1 runs all three to 6 tokens, batch 2 its single request to 4.
    assert res.computed_output_tokens == 3 * 6 + 4
    assert res.tokens_per_s > 0


def test_report_ratios_and_flops(tiny_llama: Any) -> None:
    mk = lambda kind, tokens, secs: SystemResult(  # noqa: E731
        kind=kind, name=kind, num_requests=4, prompt_tokens=14, output_tokens=tokens,
        computed_output_tokens=tokens, seconds=secs,
    )  # fmt: skip
    results = [
        mk("ours", 15, 1.0),
        mk("ours@2", 15, 2.0),
        mk("hf_single", 15, 10.0),
        mk("hf_static", 15, 2.0),
    ]
    roof = [
        common.RooflineResult(dtype="float32", device="cpu", size=8, reps=1, seconds_per_matmul=1, gflops=1)
    ]
    rep = engine_throughput.report(tiny_llama.config, TINY_WORKLOAD, results, roof)
    assert rep.ratios == {
        "ours/hf_single": pytest.approx(10.0),
        "ours/hf_static": pytest.approx(2.0),
        "ours@2/hf_single": pytest.approx(5.0),
        "ours@2/hf_static": pytest.approx(1.0),
    }
    assert rep.gflops["ours"] == pytest.approx(10 * rep.gflops["hf_single"])
    engine_throughput.print_report(rep)


def test_matmul_params_match_the_real_weight_count(tiny_llama: Any) -> None:
    cfg = tiny_llama.config
    total = sum(p.numel() for p in tiny_llama.parameters())
    embedding = cfg.vocab_size * cfg.hidden_size
    norms = cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    assert common.matmul_params(cfg) == total - embedding - norms
    assert common.request_flops(cfg, 3, 2) == pytest.approx(
        5 * common.flops_per_token(cfg) + common.attention_flops(cfg, 5)
    )


def test_matmul_roofline_reports_positive_throughput() -> None:
    res = common.matmul_roofline("float32", size=128, reps=2)
    assert res.gflops > 0 and res.seconds_per_matmul > 0


def test_rss_monitor_sees_an_allocation() -> None:
    # A fresh anonymous mapping, touched page by page: always new resident memory, whatever
    # the allocator kept from earlier tests in this process (a freed torch tensor may not be).
    # The process's RSS is not ours alone: an earlier test's engine, collected meanwhile, can
    # shrink it by more than we add, so the peak is checked against the RSS seen with the
    # block held, not against the start.
    gc.collect()
    size = 64 * 2**20
    with common.RSSMonitor() as mon:
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        held = psutil.Process().memory_info().rss
        wait_for(lambda: mon.peak_bytes >= held - 8 * 2**20, timeout=10, what="a sample with the block held")
        block.close()
    # The kernel's high-water mark and /proc's current RSS are counted a little differently.
    assert common.process_peak_rss_bytes() >= 0.95 * mon.peak_bytes


def test_data_loaders(shared_data: Path) -> None:
    prompts = inputs.load_sharegpt_prompts()
    assert len(prompts) > 400 and all(p.strip() for p in prompts)
    a = inputs.load_azure_output_lengths(200, seed=1)
    assert a == inputs.load_azure_output_lengths(200, seed=1)
    assert a != inputs.load_azure_output_lengths(200, seed=2)
    assert all(16 <= n <= 256 for n in a) and len(set(a)) > 20


@pytest.mark.parametrize("module", [engine_throughput, prefix_cache, kv_offload, long_prefill])
def test_missing_data_exits_with_code_2(
    module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FLEET_SHARED_DATA", str(tmp_path))
    assert common.run_main(module.main, []) == common.EXIT_MISSING_INPUT
    assert "FLEET_SHARED_DATA" in capsys.readouterr().out


def test_kv_offload_report_reads_returning_prefixes_against_off_and_the_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def config(name: str, cold: float, back: float, tokens: list[int]) -> kv_offload.ConfigResult:
        samples = [
            kv_offload.Sample(
                prefix=i, round=r, prompt_tokens=100, cached_tokens=96 * r, ttft_s=cold if r == 0 else back,
                token_ids=tokens,
            )
            for r in range(2)
            for i in range(3)
        ]  # fmt: skip
        return kv_offload.ConfigResult(
            name=name, device_blocks=8, host_gib=0.0, samples=samples, host_hit_blocks=0, offload_bytes=0,
            load_bytes=0,
        )  # fmt: skip

    report = kv_offload.Report(
        prefixes=3,
        prefix_tokens=96,
        rounds=2,
        block_size=16,
        results=[
            config("off", 1.0, 1.0, [1, 2]),
            config("host tier", 1.0, 0.25, [1, 2]),
            config("all on device", 1.0, 0.2, [1, 3]),
        ],
    )
    kv_offload.print_report(report)
    out = capsys.readouterr().out
    assert "4.00" in out  # off / host tier
    assert "1.25" in out  # host tier / all on device
    assert "NO" in out  # the bound's tokens differ in this made-up report


def test_long_prefill_report_reads_the_cap_against_off(capsys: pytest.CaptureFixture[str]) -> None:
    def rnd(config: str, long: float, short: float, tokens: list[int]) -> long_prefill.Round:
        return long_prefill.Round(
            config=config, long_ttft_s=long, short_ttft_s=[short] * 4, wall_s=long + 0.1, token_ids=[tokens]
        )

    results = [rnd("off", 1.0, 1.0, [1]), rnd("cap 64", 1.2, 0.1, [1])] * 2
    report = long_prefill.Report(rounds=2, long_tokens=100, shorts=4, budget=32, threshold=8, results=results)
    long_prefill.print_report(report, ["off", "cap 64"])
    out = capsys.readouterr().out
    assert "10.00" in out  # short TTFT, off / cap
    assert "0.83" in out  # long TTFT, off / cap: the cap's cost
    assert "NO" not in out


# ---------------------------------------------------------------- real model and engine

BLOCK = 16


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Any:
    engine = pytest.importorskip("engine")
    if not hasattr(engine, "LLM"):
        pytest.skip("engine.LLM is not there yet")
    return engine.LLM(model="smollm2-135m", max_num_seqs=8, block_size=BLOCK)


@pytest.mark.slow
def test_ours_throughput_smoke(llm: Any, shared_data: Path) -> None:
    texts = inputs.load_sharegpt_prompts()
    workload = engine_throughput.make_workload(llm.tokenizer, texts, [4, 3], max_prompt_tokens=64)
    assert all(len(p) <= 64 for p in workload.prompts)
    res = engine_throughput.run_ours(llm, workload)
    assert res.output_tokens == 7 and res.computed_output_tokens == 7
    assert res.tokens_per_s > 0


@pytest.mark.slow
def test_prefix_cache_smoke(llm: Any, shared_data: Path) -> None:
    texts = inputs.load_sharegpt_prompts()
    workload = prefix_cache.build_prefix_workload(llm.tokenizer, texts, num_requests=2, system_tokens=64)
    assert 60 <= workload.system_tokens <= 68
    assert workload.shared_prefix_tokens >= workload.system_tokens
    res = prefix_cache.run_prefix_bench(llm, workload)
    assert [s.cached_tokens for s in res.cold] == [0, 0]
    full_blocks = workload.shared_prefix_tokens // BLOCK * BLOCK
    assert all(s.cached_tokens >= full_blocks for s in res.cached)
    assert all(s.ttft_s > 0 and s.wall_s >= s.ttft_s * 0.999 for s in res.cold + res.cached)
    prefix_cache.print_result(res)
    json.loads(res.model_dump_json())


def test_structured_outputs_bench_measures_both_engines(smollm2_gguf: Path) -> None:
    from bench import structured_outputs
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_gguf)
    schema = structured_outputs.wide_schema(4)
    compile_rows = structured_outputs.compile_times(tok, tok.vocab_size, schema)
    assert [r[0] for r in compile_rows] == ["xgrammar (engine)", "llguidance"]
    assert all(isinstance(v, float) and v >= 0 for v in compile_rows[0][1:])
    mask_rows = structured_outputs.mask_costs(tok, tok.vocab_size, schema, batch=2)
    assert mask_rows[0][1] == mask_rows[1][1] > 5  # both walked the whole document
