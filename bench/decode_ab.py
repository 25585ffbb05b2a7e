"""Decode speed of engine variants (weight format x thread setting), interleaved in one run.

On a shared CPU the load changes from minute to minute, so variants are measured in rounds:
each round runs `--steps` decode steps of every variant in turn, and a variant's figure is
its total over all rounds. Variants are `weights@threads`: weights one of fp32 | fp16 | bf16 | int8
| int4 | auto, threads a number (pinned) or `auto` (engine.threads tunes per step).

    PYTHONPATH=. .venv/bin/python -m bench.decode_ab --batch-sizes 1 64 \\
        --variants fp32@2 fp32@1 fp32@auto bf16@auto int8@auto int4@auto
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import console, machine_note, print_table, run_main
from bench.inputs import chat_token_ids, load_hf_tokenizer, load_sharegpt_prompts, resolve_model


def start_batch(llm: Any, prompts: list[list[int]], batch_size: int, max_tokens: int) -> list[str]:
    """Queue `batch_size` greedy requests and run until every one is decoding."""
    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(prompts[i % len(prompts)], params) for i in range(batch_size)]
    while eng.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
    return ids


def run_variant(llm: Any, threads: str, tuner: Any, steps: int) -> float:
    runner = llm.engine.runner
    if threads == "auto":
        runner.threads = tuner
    else:
        runner.threads = None
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return time.perf_counter() - t0


def compare(
    llms: dict[str, Any],
    variants: list[str],
    prompts: list[list[int]],
    batch_size: int,
    steps: int,
    rounds: int,
) -> dict[str, float]:
    """Decode tokens/s per variant at `batch_size`."""
    tuners = {w: llm.engine.runner.threads for w, llm in llms.items()}
    started = {
        w: start_batch(llm, prompts, batch_size, steps * rounds * len(variants) + 8)
        for w, llm in llms.items()
    }
    seconds = dict.fromkeys(variants, 0.0)
    for _ in range(rounds):
        for v in variants:
            w, threads = v.split("@")
            seconds[v] += run_variant(llms[w], threads, tuners[w], steps)
    for w, llm in llms.items():
        for rid in started[w]:
            llm.engine.abort_request(rid)
        llm.engine.runner.threads = tuners[w]
        llm.reset_prefix_cache()
    return {v: batch_size * steps * rounds / s for v, s in seconds.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--variants", nargs="+", default=["fp32@auto", "bf16@auto", "int8@auto", "int4@auto"])
    p.add_argument("--steps", type=int, default=4, help="decode steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from engine import LLM

    args = parse_args(argv)
    model_path = resolve_model(args.model)
    tok = load_hf_tokenizer(model_path)
    prompts = [chat_token_ids(tok, t) for t in load_sharegpt_prompts()[:200]]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    weights = list(dict.fromkeys(v.split("@")[0] for v in args.variants))
    llms = {w: LLM(model=args.model, weights=w, show_progress=False) for w in weights}
    console.print(f"start: {machine_note('cpu', torch.get_num_threads())}")
    table = {b: compare(llms, args.variants, prompts, b, args.steps, args.rounds) for b in args.batch_sizes}
    base = args.variants[0]
    print_table(
        "Decode tokens/s by variant (interleaved rounds)",
        ["variant"]
        + [f"B={b} tok/s" for b in args.batch_sizes]
        + [f"B={b} vs {base}" for b in args.batch_sizes],
        [
            [v]
            + [table[b][v] for b in args.batch_sizes]
            + [table[b][v] / table[b][base] for b in args.batch_sizes]
            for v in args.variants
        ],
    )
    console.print(f"end: {machine_note('cpu', torch.get_num_threads())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
