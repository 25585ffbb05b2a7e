"""Time to first token of short prompts that arrive with a long one, the long-prefill cap on
vs off (`--long-prefill-token-threshold`), on the real engine.

Each round submits one long prompt (a distinct window of ShareGPT text) and then several
short ones (distinct questions) at once, greedy; the long one is first in line. Without the
cap the long prompt takes every step's budget until its prefill is done, and the short ones
wait for all of it; with it, the long prompt takes at most T tokens a step and the short ones
are prefilled in the next step. Both engines are loaded once and serve the same rounds in
alternating order (off first, then on first), so drift on a shared machine hits both.

Reported per config: the short prompts' TTFT p50 / p90, the long prompt's TTFT (what the cap
costs it), the round's wall time, and whether greedy output is token-for-token the same with
the cap on and off. It measures and prints; it asserts nothing about time.

    PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.long_prefill
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pydantic import BaseModel

from bench.common import machine_note, print_table, progress, resolve_device, run_main, write_json
from bench.inputs import resolve_model
from bench.kv_offload import build_prefixes


class Round(BaseModel):
    config: str
    long_ttft_s: float
    short_ttft_s: list[float]
    wall_s: float
    token_ids: list[list[int]]


class Report(BaseModel):
    rounds: int
    long_tokens: int
    shorts: int
    budget: int
    threshold: int
    results: list[Round]


def run_round(name: str, llm: Any, prompts: list[list[int]], max_tokens: int) -> Round:
    from engine import SamplingParams

    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    wall = time.perf_counter() - started
    ttfts = []
    for out in outs:
        assert out.metrics is not None and out.metrics.ttft is not None
        ttfts.append(out.metrics.ttft)
    return Round(
        config=name,
        long_ttft_s=ttfts[0],
        short_ttft_s=ttfts[1:],
        wall_s=wall,
        token_ids=[o.token_ids for o in outs],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--shorts", type=int, default=4, help="short prompts submitted behind each long one")
    p.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens of both engines")
    p.add_argument(
        "--threshold", type=int, default=64, help="--long-prefill-token-threshold of the capped one"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="pin torch threads (default: tuned)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine import LLM
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model("smollm2-135m"))  # found without importing it
    longs = build_prefixes(tok, args.rounds, args.long_tokens)
    rounds = []
    for i, long in enumerate(longs):
        shorts = [
            tok.encode_chat([{"role": "user", "content": f"Round {i}: name a color, {j}."}])
            for j in range(args.shorts)
        ]
        rounds.append([long, *shorts])
    common: dict[str, Any] = {
        "device": "cpu",
        "max_model_len": args.long_tokens + args.max_tokens + 64,
        "max_num_batched_tokens": args.budget,
        "enable_prefix_caching": False,  # every round cold: the cap, not the cache, is measured
        "speculative_config": None,
    }
    if args.threads is not None:
        common["num_threads"] = args.threads
    engines = {
        "off": LLM("smollm2-135m", show_progress=False, **common),
        f"cap {args.threshold}": LLM(
            "smollm2-135m", show_progress=False, long_prefill_token_threshold=args.threshold, **common
        ),
    }
    for llm in engines.values():  # warm-up
        run_round("warm-up", llm, rounds[0][1:], args.max_tokens)
    results = []
    names = list(engines)
    with progress(len(rounds) * len(names), "rounds", unit="round") as tick:
        for i, prompts in enumerate(rounds):
            for name in names if i % 2 == 0 else reversed(names):
                results.append(run_round(name, engines[name], prompts, args.max_tokens))
                tick(1)
    report = Report(
        rounds=args.rounds,
        long_tokens=args.long_tokens,
        shorts=args.shorts,
        budget=args.budget,
        threshold=args.threshold,
        results=results,
    )
    print_report(report, names)
    print(machine_note(resolve_device("cpu"), __import__("torch").get_num_threads()))
    write_json(args.json, report)
    return 0


def print_report(report: Report, names: list[str]) -> None:
    ms = 1000.0
    by: dict[str, list[Round]] = {n: [r for r in report.results if r.config == n] for n in names}
    base = by[names[0]]
    rows = []
    for name in names:
        rs = by[name]
        shorts = sorted(t for r in rs for t in r.short_ttft_s)
        same = all(a.token_ids == b.token_ids for a, b in zip(rs, base, strict=True))
        rows.append(
            [
                name,
                statistics.median(shorts) * ms,
                shorts[min(len(shorts) - 1, int(0.9 * len(shorts)))] * ms,
                statistics.median(r.long_ttft_s for r in rs) * ms,
                statistics.median(r.wall_s for r in rs) * ms,
                "yes" if same else "NO",
            ]
        )
    off, on = rows[0], rows[1]
    rows.append(["off / cap", off[1] / on[1], off[2] / on[2], off[3] / on[3], off[4] / on[4], ""])
    print_table(
        f"{report.rounds} rounds: one {report.long_tokens}-token prompt, then {report.shorts} short ones "
        f"(budget {report.budget} tokens a step, cap {report.threshold})",
        [
            "config",
            "short TTFT p50 ms",
            "short TTFT p90 ms",
            "long TTFT p50 ms",
            "round wall p50 ms",
            "output = off",
        ],
        rows,
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
