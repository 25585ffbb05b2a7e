"""Multi-LoRA throughput: one batch of requests spread over 0, 1, 4 and 16 adapters, same run.

The real SmolLM2-135M base; random rank-8 PEFT adapters on every projection (q/k/v/o and the
MLP), written to a temporary directory (nothing from a hub). Every configuration runs the
same prompts, greedy with ignore_eos, so each emits exactly `--max-tokens` tokens; the base
alone is the baseline (the cost of mixing = the drop from it). Also: adapter load time
(read + check from disk) and slot load time (into the device stacks).

    PYTHONPATH=. .venv/bin/python -m bench.lora --batch 32 --max-tokens 16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import console, machine_note, print_table, run_main
from bench.common import set_threads as _set_threads
from bench.inputs import load_sharegpt_prompts, resolve_model
from engine.config import ModelConfig
from engine.lora.adapter import module_shapes

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(
    out: Path,
    cfg: ModelConfig,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_MODULES,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) with random A and
    non-zero random B, the tensor names and shapes PEFT's save_pretrained writes."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in targets:
            fan_in, fan_out = shapes[m]
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            p = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{p}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(
    model: str, batch: int, max_tokens: int, counts: list[int], rank: int, rounds: int = 1
) -> list[list[object]]:
    """One row per configuration. With several rounds the order alternates (forward, then
    backward) and each configuration keeps its fastest round, so a machine whose load drifts
    during the run favours none of them."""
    from engine import LLM, SamplingParams

    path = resolve_model(model)
    top = max(counts)
    llm = LLM(str(path), enable_lora=True, max_loras=max(top, 1), max_lora_rank=rank, show_progress=False)
    texts = load_sharegpt_prompts()[:batch]
    prompts = [llm.tokenizer.encode(t[:400], add_special_tokens=True) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    load_s = []
    with tempfile.TemporaryDirectory(prefix="fleet-lora-bench-") as tmp:
        for i in range(top):
            d = write_random_adapter(Path(tmp) / f"a{i}", llm.model_config, rank=rank, seed=i)
            t0 = time.perf_counter()
            llm.add_lora(f"a{i}", str(d))
            load_s.append(time.perf_counter() - t0)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        manager = llm.engine.lora
        assert manager is not None
        configs = [0, *counts]
        best: dict[int, tuple[float, int, int]] = {}  # n -> (wall, tokens, slot loads)
        for r in range(rounds):
            for n in configs if r % 2 == 0 else configs[::-1]:
                names = [None] * batch if n == 0 else [f"a{i % n}" for i in range(batch)]
                slot_before = manager.slot_loads_total
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora=names)
                wall = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                console.print(
                    f"round {r + 1}, {n} adapters: {tokens} tokens in {wall:.1f} s", highlight=False
                )
                loads = manager.slot_loads_total - slot_before
                if n not in best or wall < best[n][0]:
                    best[n] = (wall, tokens, loads)
        rows: list[list[object]] = []
        base_tps = best[0][1] / best[0][0]
        for n in configs:
            wall, tokens, loads = best[n]
            tps = tokens / wall
            label = "base alone" if n == 0 else f"{n} adapter{'s' if n > 1 else ''}"
            rows.append([label, batch, tokens, wall, tps, tps / base_tps, loads])
    mean_load = sum(load_s) / len(load_s) if load_s else None
    console.print(f"adapter load (read + check, rank {rank}, all 7 projections): mean {mean_load:.3f} s "
                  f"over {len(load_s)}; slot stacks {manager.slots.bytes / 2**20:.0f} MiB")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapters", default="1,4,16", help="comma-separated adapter counts")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; each config keeps its best")
    ns = ap.parse_args(argv)
    threads = _set_threads(ns.threads)
    counts = [int(x) for x in ns.adapters.split(",") if x]
    rows = run(ns.model, ns.batch, ns.max_tokens, counts, ns.rank, ns.rounds)
    print_table(
        f"Multi-LoRA: a batch of {ns.batch} over N adapters vs the base alone "
        f"(one run, best of {ns.rounds} alternating rounds)",
        ["config", "requests", "tokens", "wall s", "tokens/s", "vs base", "slot loads"],
        rows,
        caption=machine_note("cpu", threads),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
