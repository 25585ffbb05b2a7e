"""Greedy agreement of each weight format with fp32 on real prompts.

Every format decodes the same ShareGPT prompts greedily; a format's figures are the share of
requests whose tokens equal fp32's exactly and the mean share of tokens before the first
divergence (a near-tie flip early on changes everything after it, so this is a lower bound on
per-token agreement).

    PYTHONPATH=. .venv/bin/python -m bench.weights_agreement --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import (
    chat_token_ids,
    console,
    load_hf_tokenizer,
    load_sharegpt_prompts,
    machine_note,
    print_table,
    resolve_model,
    run_main,
)


def prefix_match(a: list[int], b: list[int]) -> float:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n / max(1, len(a))


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    exact = sum(a == b for a, b in zip(ref, other)) / len(ref)
    return exact, sum(prefix_match(a, b) for a, b in zip(ref, other)) / len(ref)


def generate(model: str, weights: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm: Any = LLM(model=model, weights=weights, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    return outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4"])
    args = p.parse_args(argv)
    tok = load_hf_tokenizer(resolve_model(args.model))
    prompts = [chat_token_ids(tok, t) for t in load_sharegpt_prompts()[: 4 * args.num_prompts]]
    prompts = [x for x in prompts if len(x) <= args.max_prompt_tokens][: args.num_prompts]
    console.print(machine_note("cpu", 0))
    ref = generate(args.model, "fp32", prompts, args.max_tokens)
    rows = []
    for fmt in args.formats:
        exact, prefix = agreement(ref, generate(args.model, fmt, prompts, args.max_tokens))
        rows.append([fmt, 100 * exact, 100 * prefix])
        console.print(f"{fmt}: {100 * exact:.0f}% identical, {100 * prefix:.0f}% before first divergence")
    print_table(
        f"Greedy agreement with fp32 ({len(prompts)} ShareGPT prompts, {args.max_tokens} tokens each)",
        ["weights", "% requests identical", "% tokens before first divergence"],
        rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
