"""Greedy agreement of each weight format with fp32, and with transformers' near-tie rule.

Every format decodes the same ShareGPT prompts greedily; a format's figures are the share of
requests whose tokens equal fp32's exactly, the mean share of tokens before the first
divergence (a near-tie flip early on changes everything after it, so this is a lower bound on
per-token agreement), the first divergence positions, and with `--vs-hf` the correctness
gate of tests/engine/test_correctness_hf.py: where a stream departs from transformers' float32
greedy choice, transformers' top-2 logit margin there must be under the near-tie tolerance.

A format may be `auto=LIST`: `--weights auto` with FLEET_WEIGHTS_AUTO_CANDIDATES=LIST (so
`auto=bf16` is bf16 for the linears and the LM head at every M).

    PYTHONPATH=. .venv/bin/python -m bench.weights_agreement --num-prompts 16 --max-tokens 32 \\
        --max-prompt-tokens 384 --formats fp16 bf16 auto=bf16 --vs-hf
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from bench.common import console, machine_note, print_table, run_main
from bench.inputs import (
    chat_token_ids,
    load_hf_model,
    load_hf_tokenizer,
    load_sharegpt_prompts,
    resolve_model,
)

NEAR_TIE = 0.02  # tests/engine/test_correctness_hf.py's tolerance


def prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_match(a: list[int], b: list[int]) -> float:
    return prefix_len(a, b) / max(1, len(a))


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    exact = sum(a == b for a, b in zip(ref, other)) / len(ref)
    return exact, sum(prefix_match(a, b) for a, b in zip(ref, other)) / len(ref)


def divergences(ref: list[list[int]], other: list[list[int]]) -> list[int]:
    """Step of the first divergence from `ref`, for each request that diverges."""
    return [prefix_len(a, b) for a, b in zip(ref, other) if a != b]


def near_tie_failures(
    prompts: list[list[int]], streams: list[list[int]], hf_top: Callable[[list[int], list[int]], Any]
) -> list[tuple[int, int, float]]:
    """(request, step, transformers' margin) where a stream first departs from transformers'
    greedy choice at a step that was not a near-tie."""
    bad = []
    for i, (prompt, got) in enumerate(zip(prompts, streams)):
        want, margins = hf_top(prompt, got)
        k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is not None and margins[k] >= NEAR_TIE:
            bad.append((i, k, margins[k]))
    return bad


def hf_scorer(path: Any) -> Callable[[list[int], list[int]], tuple[list[int], list[float]]]:
    """transformers' greedy choice and top-2 margin at every step of a stream (one teacher-
    forced forward pass per stream; up to the first departure it is transformers' own run)."""
    import torch

    model = load_hf_model(path)

    def score(prompt: list[int], stream: list[int]) -> tuple[list[int], list[float]]:
        with torch.inference_mode():
            ids = torch.tensor([prompt + stream[:-1]])
            logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
        top2 = torch.topk(logits, 2, dim=-1)
        return top2.indices[:, 0].tolist(), (top2.values[:, 0] - top2.values[:, 1]).tolist()

    return score


def generate(model: str, weights: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import LLM, SamplingParams
    from engine.model.weights_choice import CANDIDATES_ENV

    fmt, _, forced = weights.partition("=")
    previous = os.environ.get(CANDIDATES_ENV)
    if forced:
        os.environ[CANDIDATES_ENV] = forced
    try:
        llm: Any = LLM(model=model, weights=fmt, show_progress=False, max_num_seqs=len(prompts))
    finally:
        if forced and previous is None:
            del os.environ[CANDIDATES_ENV]
        elif forced:
            os.environ[CANDIDATES_ENV] = previous
    console.print(f"{weights}: weights plan {llm.engine.runner.weights_plan}")
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
    p.add_argument("--vs-hf", action="store_true", help="also apply the near-tie gate against transformers")
    args = p.parse_args(argv)
    path = resolve_model(args.model)
    tok = load_hf_tokenizer(path)
    prompts = [chat_token_ids(tok, t) for t in load_sharegpt_prompts()[: 4 * args.num_prompts]]
    prompts = [x for x in prompts if len(x) <= args.max_prompt_tokens][: args.num_prompts]
    console.print(machine_note("cpu", 0))
    hf_top = hf_scorer(path) if args.vs_hf else None
    ref = generate(args.model, "fp32", prompts, args.max_tokens)
    runs = [("fp32", ref)] if hf_top else []
    rows = []
    for fmt in args.formats:
        streams = generate(args.model, fmt, prompts, args.max_tokens)
        runs.append((fmt, streams))
        exact, prefix = agreement(ref, streams)
        rows.append(
            [fmt, 100 * exact, 100 * prefix, " ".join(map(str, sorted(divergences(ref, streams)))) or "-"]
        )
        console.print(f"{fmt}: {100 * exact:.0f}% identical, {100 * prefix:.0f}% before first divergence")
    print_table(
        f"Greedy agreement with fp32 ({len(prompts)} ShareGPT prompts, {args.max_tokens} tokens each)",
        ["weights", "% requests identical", "% tokens before first divergence", "first divergence steps"],
        rows,
    )
    if hf_top:
        gate = []
        for fmt, streams in runs:
            bad = near_tie_failures(prompts, streams, hf_top)
            detail = "; ".join(f"req {i} step {k} margin {m:.3f}" for i, k, m in bad) or "-"
            gate.append(
                [fmt, f"{len(prompts) - len(bad)}/{len(prompts)}", "PASS" if not bad else "FAIL", detail]
            )
        print_table(
            f"Near-tie gate vs transformers fp32 (departures only where its top-2 margin < {NEAR_TIE})",
            ["weights", "requests within tolerance", "gate", "departures beyond it"],
            gate,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
