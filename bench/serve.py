"""Online serving: the engine's HTTP server under concurrent streaming clients, against the
offline `LLM` on the same requests.

ShareGPT first turns are sent as streaming chat completions (greedy, ignore_eos, a fixed
number of output tokens each) at several concurrency levels. Per level it prints TTFT and
inter-token latency percentiles (measured by the client) and output tokens/s. The same
requests also go through `engine.LLM` in this process, all at once, before and after the
server levels (never while the server runs, so the two do not share the CPU); each level's
throughput is shown as a fraction of the pooled offline throughput, since load on a shared
machine drifts.

    PYTHONPATH=. .venv/bin/python -m bench.serve --num-prompts 64 --max-tokens 32
    PYTHONPATH=. .venv/bin/python -m bench.serve --url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, computed_field

from bench.common import console, openai_client, print_table, progress, run_bounded, run_main, set_threads
from bench.inputs import load_sharegpt_prompts, resolve_model

GOAL_FRACTION_AT_32 = 0.85


class RequestTiming(BaseModel):
    ttft: float
    itls: list[float]
    output_tokens: int
    e2e: float


class LevelResult(BaseModel):
    concurrency: int
    num_requests: int
    seconds: float
    output_tokens: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    errors: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def pick_prompts(
    texts: Sequence[str], tokenizer: Any, n: int, max_prompt_tokens: int
) -> list[tuple[str, int]]:
    """The first `n` prompts whose chat-templated length fits; (text, prompt tokens)."""
    picked: list[tuple[str, int]] = []
    for text in texts:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        if len(ids) <= max_prompt_tokens:
            picked.append((text, len(ids)))
            if len(picked) == n:
                return picked
    raise ValueError(
        f"only {len(picked)} ShareGPT prompts have at most {max_prompt_tokens} tokens; asked for {n}"
    )


def summarize(concurrency: int, timings: list[RequestTiming], seconds: float, errors: int) -> LevelResult:
    ttft = np.array([t.ttft for t in timings]) if timings else np.zeros(1)
    itl = np.array([x for t in timings for x in t.itls]) if any(t.itls for t in timings) else np.zeros(1)
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(timings),
        seconds=seconds,
        output_tokens=sum(t.output_tokens for t in timings),
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        itl_p50=float(np.percentile(itl, 50)),
        itl_p99=float(np.percentile(itl, 99)),
        errors=errors,
    )


async def one_request(client: Any, model: str, text: str, max_tokens: int) -> RequestTiming:
    """One streamed chat completion; token times are when their chunks arrive here."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = 0
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].logprobs):
            arrivals.append(now)
    end = time.perf_counter()
    if not arrivals:
        arrivals = [end]
    return RequestTiming(
        ttft=arrivals[0] - t0,
        itls=[b - a for a, b in itertools.pairwise(arrivals)],
        output_tokens=usage_tokens,
        e2e=end - t0,
    )


async def run_level(
    url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    concurrency: int,
    api_key: str = "unused",
    tick: Callable[[int], object] | None = None,
) -> LevelResult:
    """All `prompts` through the server with at most `concurrency` in flight."""
    import openai

    client = openai_client(url, concurrency, 600.0, api_key)
    async with client:
        await one_request(client, model, prompts[0], 2)  # warm-up: connections, first-step costs
        t0 = time.perf_counter()
        requests = [functools.partial(one_request, client, model, p, max_tokens) for p in prompts]
        results = await run_bounded(requests, concurrency, (openai.APIError,), tick)
        seconds = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    return summarize(concurrency, done, seconds, len(results) - len(done))


class OfflineResult(BaseModel):
    num_requests: int
    output_tokens: int
    seconds: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def load_offline(model: str, engine_args: dict[str, Any]) -> Any:
    from engine import LLM

    return LLM(model=model, **engine_args)


def run_offline(llm: Any, prompts: Sequence[str], max_tokens: int) -> OfflineResult:
    """The same chat requests through `engine.LLM`, all submitted at once."""
    from engine import SamplingParams

    convs = [[{"role": "user", "content": p}] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.chat(convs[:1], warm, use_tqdm=False)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    seconds = time.perf_counter() - t0
    llm.reset_prefix_cache()
    return OfflineResult(
        num_requests=len(outs), output_tokens=sum(len(o.token_ids) for o in outs), seconds=seconds
    )


def combined(runs: Sequence[OfflineResult]) -> OfflineResult | None:
    """Offline runs before and after the server levels pooled: on a shared machine the load
    drifts, and bracketing the server runs keeps the ratio honest."""
    if not runs:
        return None
    return OfflineResult(
        num_requests=runs[0].num_requests,
        output_tokens=sum(r.output_tokens for r in runs),
        seconds=sum(r.seconds for r in runs),
    )


def print_results(levels: list[LevelResult], offline_runs: Sequence[OfflineResult], caption: str) -> None:
    ref = combined(offline_runs)
    rows: list[list[object]] = []
    for r in levels:
        frac = r.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s > 0 else None
        row = [r.concurrency, r.num_requests, r.ttft_p50 * 1e3, r.ttft_p99 * 1e3, r.itl_p50 * 1e3]
        rows.append([*row, r.itl_p99 * 1e3, r.tokens_per_s, frac, r.errors])
    labels = ["offline LLM (before)", "offline LLM (after)"] if len(offline_runs) == 2 else ["offline LLM"]
    for label, run in zip(labels, offline_runs, strict=False):
        frac = run.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s > 0 else None
        rows.append([label, run.num_requests, None, None, None, None, run.tokens_per_s, frac, 0])
    columns = ["concurrency", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"]
    columns += ["output tok/s", "vs offline", "errors"]
    print_table("engine server vs offline LLM (streamed chat, greedy, ignore_eos)", columns, rows, caption)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--url", default=None, help="use this running server instead of starting one")
    p.add_argument("--served-model-name", default=None, help="model name at --url (default: --model)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (EOS ignored)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer ShareGPT prompts")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="server and offline engine (default: the engine's)"
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep prefix caching on (off by default: later levels would replay prompts already cached)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads, server and offline alike")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console.width = max(console.width, 132)
    from engine.server.process import ServerProcess
    from engine.tokenizer import Tokenizer

    levels_c = [int(x) for x in args.concurrency.split(",") if x.strip()]
    tokenizer = Tokenizer.from_path(resolve_model(args.model))
    picked = pick_prompts(load_sharegpt_prompts(), tokenizer, args.num_prompts, args.max_prompt_tokens)
    prompts = [t for t, _ in picked]
    console.print(
        f"{len(prompts)} ShareGPT prompts ({sum(n for _, n in picked):,} prompt tokens under the chat template), "
        f"{args.max_tokens} output tokens each; concurrency {levels_c}"
    )
    engine_args: dict[str, Any] = {"enable_prefix_caching": args.prefix_caching}
    if args.max_num_seqs is not None:
        engine_args["max_num_seqs"] = args.max_num_seqs

    offline_runs: list[OfflineResult] = []
    llm = None
    if not args.skip_offline:
        set_threads(args.threads)
        console.print("offline LLM on the same requests (before the server runs) ...")
        llm = load_offline(args.model, engine_args)
        offline_runs.append(run_offline(llm, prompts, args.max_tokens))

    server: ServerProcess | None = None
    url = args.url
    name = args.served_model_name or args.model
    if url is None:
        extra = ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
        extra += [] if args.prefix_caching else ["--no-prefix-caching"]
        extra += ["--threads", str(args.threads)] if args.threads else []
        log = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "server.log"
        console.print(f"starting python -m engine.server (log: {log}) ...")
        server = ServerProcess(*extra, model=args.model, log_path=log).start()
        url = server.url
    results: list[LevelResult] = []
    try:
        for c in levels_c:
            with progress(len(prompts), f"server, concurrency {c}") as tick:
                results.append(
                    asyncio.run(run_level(url, name, prompts, args.max_tokens, c, args.api_key, tick))
                )
    finally:
        if server is not None:
            server.stop()

    if llm is not None:
        console.print("offline LLM again (after the server runs) ...")
        offline_runs.append(run_offline(llm, prompts, args.max_tokens))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    caption = (
        "TTFT and ITL measured at the client; tok/s = completion tokens / wall time of the level; "
        "'vs offline' divides by the pooled offline runs; "
        f"prefix caching {'on' if args.prefix_caching else 'off'} in both. "
        f"Goal: >= {GOAL_FRACTION_AT_32} of offline at concurrency 32. {os.cpu_count()} CPUs, load average {load}."
    )
    print_results(results, offline_runs, caption)
    if args.json_path:
        payload = {
            "levels": [r.model_dump() for r in results],
            "offline": [r.model_dump() for r in offline_runs],
        }
        Path(args.json_path).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
