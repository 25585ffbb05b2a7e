"""Time to first token with a shared ~1,000-token system prompt: cold vs prefix-cached.

32 requests share one system prompt (real ShareGPT text, concatenated up to ~1,000 tokens)
and each asks its own ShareGPT question; max_tokens=1, greedy. Every request runs alone:
cold after `llm.reset_prefix_cache()`, cached after one warming request with the same
system prompt. TTFT is the engine's own `RequestOutput.metrics.ttft` (arrival to first
token); the wall time of the one-request `generate` call is shown beside it.

    PYTHONPATH=. .venv/bin/python -m bench.prefix_cache
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from bench.common import (
    console,
    machine_note,
    print_table,
    progress,
    resolve_device,
    run_main,
    set_threads,
    write_json,
)
from bench.inputs import chat_token_ids, encode, load_hf_tokenizer, load_sharegpt_prompts, resolve_model

GOAL_CACHED_OVER_COLD = 0.25


class PrefixWorkload(BaseModel):
    system_prompt: str
    system_tokens: int  # the system text alone, by the model's tokenizer
    shared_prefix_tokens: int  # identical leading token ids of every request (template included)
    prompts: list[list[int]]
    warm_prompt: list[int]  # same system prompt, a question none of `prompts` asks


class TTFTSample(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float  # engine metric if it reports one, else the call's wall time
    wall_s: float


class PrefixResult(BaseModel):
    workload_prompts: int
    shared_prefix_tokens: int
    ttft_source: str
    cold: list[TTFTSample]
    cached: list[TTFTSample]

    @property
    def ratio_p50(self) -> float:
        return p50([s.ttft_s for s in self.cached]) / p50([s.ttft_s for s in self.cold])

    @property
    def ratio_mean(self) -> float:
        return statistics.fmean(s.ttft_s for s in self.cached) / statistics.fmean(s.ttft_s for s in self.cold)


def p50(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def build_system_prompt(tokenizer: Any, texts: Sequence[str], target_tokens: int) -> tuple[str, int, int]:
    """Real text of about `target_tokens` tokens: whole ShareGPT turns, the last one cut to fit.
    Returns the text, its token count and how many turns it used."""
    parts: list[str] = []
    count = 0
    for text in texts:
        ids = encode(tokenizer, text)
        room = target_tokens - count
        if len(ids) >= room:
            parts.append(tokenizer.decode(ids[:room]))
            break
        parts.append(text)
        count += len(ids) + 2  # + the blank line between turns
    system = "\n\n".join(parts)
    return system, len(encode(tokenizer, system)), len(parts)


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, len(s))
        n = next((i for i in range(n) if s[i] != first[i]), n)
    return n


def build_prefix_workload(
    tokenizer: Any,
    texts: Sequence[str],
    num_requests: int = 32,
    system_tokens: int = 1000,
    max_question_tokens: int = 128,
) -> PrefixWorkload:
    """System text from the longest turns; questions from the other, short ones (distinct)."""
    by_len = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    system, n_sys, n_used = build_system_prompt(tokenizer, [texts[i] for i in by_len], system_tokens)
    used = set(by_len[:n_used])  # never ask a question that is part of the system text
    questions: list[str] = []
    seen: set[str] = set()
    for i, text in enumerate(texts):
        if len(questions) == num_requests + 1:
            break
        q = text.strip()
        if i in used or q in seen or q in system:
            continue
        if len(encode(tokenizer, q)) <= max_question_tokens:
            questions.append(q)
            seen.add(q)
    if len(questions) < num_requests + 1:
        raise ValueError(f"only {len(questions)} short questions found, {num_requests + 1} needed")
    prompts = [chat_token_ids(tokenizer, q, system=system) for q in questions]
    return PrefixWorkload(
        system_prompt=system,
        system_tokens=n_sys,
        shared_prefix_tokens=common_prefix_len(prompts),
        prompts=prompts[1:],
        warm_prompt=prompts[0],
    )


def _one(llm: Any, prompt: list[int]) -> tuple[TTFTSample, bool]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metric = out.metrics.ttft if out.metrics is not None else None
    sample = TTFTSample(
        prompt_tokens=len(prompt),
        cached_tokens=out.num_cached_tokens,
        ttft_s=metric if metric is not None else wall,
        wall_s=wall,
    )
    return sample, metric is not None


def run_prefix_bench(llm: Any, workload: PrefixWorkload) -> PrefixResult:
    """Cold pass (cache reset before each request), then cached pass (one warming request)."""
    _one(llm, workload.warm_prompt[-32:])  # warm-up (kernels, thread pools), off the shared prefix
    cold: list[TTFTSample] = []
    cached: list[TTFTSample] = []
    from_metric = True
    with progress(len(workload.prompts), "cold (cache reset each time)") as tick:
        for prompt in workload.prompts:
            llm.reset_prefix_cache()
            sample, m = _one(llm, prompt)
            cold.append(sample)
            from_metric &= m
            tick(1)
    llm.reset_prefix_cache()
    _one(llm, workload.warm_prompt)
    with progress(len(workload.prompts), "cached (after one warming request)") as tick:
        for prompt in workload.prompts:
            sample, m = _one(llm, prompt)
            cached.append(sample)
            from_metric &= m
            tick(1)
    return PrefixResult(
        workload_prompts=len(workload.prompts),
        shared_prefix_tokens=workload.shared_prefix_tokens,
        ttft_source="RequestOutput.metrics.ttft" if from_metric else "wall time of generate()",
        cold=cold,
        cached=cached,
    )


def print_result(res: PrefixResult, per_request: bool = True) -> None:
    ms = 1000.0
    if per_request:
        print_table(
            "Per request",
            [
                "#",
                "prompt tok",
                "cold cached tok",
                "cold TTFT ms",
                "cached tok",
                "cached TTFT ms",
                "cached wall ms",
            ],
            [
                [
                    i,
                    c.prompt_tokens,
                    c.cached_tokens,
                    c.ttft_s * ms,
                    w.cached_tokens,
                    w.ttft_s * ms,
                    w.wall_s * ms,
                ]
                for i, (c, w) in enumerate(zip(res.cold, res.cached, strict=True))
            ],
        )
    cold = [s.ttft_s for s in res.cold]
    cached = [s.ttft_s for s in res.cached]
    print_table(
        "Prefix caching: TTFT",
        ["", "p50 ms", "mean ms", "mean cached tokens"],
        [
            [
                "cold",
                p50(cold) * ms,
                statistics.fmean(cold) * ms,
                statistics.fmean(s.cached_tokens for s in res.cold),
            ],
            [
                "cached",
                p50(cached) * ms,
                statistics.fmean(cached) * ms,
                statistics.fmean(s.cached_tokens for s in res.cached),
            ],
            ["cached / cold", res.ratio_p50, res.ratio_mean, None],
        ],
        caption=(
            f"{res.workload_prompts} requests, {res.shared_prefix_tokens} shared prefix tokens, max_tokens=1, "
            f"greedy, each request alone; TTFT = {res.ttft_source}. Goal: cached <= "
            f"{GOAL_CACHED_OVER_COLD}x cold (p50 {'met' if res.ratio_p50 <= GOAL_CACHED_OVER_COLD else 'not met'})."
        ),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-question-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the numbers here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = load_sharegpt_prompts()
    model_path = resolve_model(args.model)
    from engine import LLM

    device = resolve_device(args.device)
    console.print(machine_note(device, set_threads(args.threads)))
    tokenizer = load_hf_tokenizer(model_path)
    workload = build_prefix_workload(
        tokenizer, texts, args.num_requests, args.system_tokens, args.max_question_tokens
    )
    console.print(
        f"system prompt: {workload.system_tokens} tokens; shared prefix under the chat template: "
        f"{workload.shared_prefix_tokens} tokens"
    )
    llm = LLM(
        model=args.model, enable_prefix_caching=True, dtype=args.dtype, device=resolve_device(args.device)
    )
    res = run_prefix_bench(llm, workload)
    print_result(res)
    write_json(args.json_path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
