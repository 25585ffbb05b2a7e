"""Offline throughput: our engine vs Hugging Face transformers on the same real workload.

ShareGPT first turns (chat template applied) with output lengths drawn from the Azure 2023
conversation trace (clipped to 16..256). Every system decodes greedily and ignores EOS, so
each request produces exactly its drawn length; only those "useful" tokens are counted.

    PYTHONPATH=. .venv/bin/python -m bench.engine_throughput --num-prompts 64
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, computed_field

from bench.common import (
    DecoderShape,
    RooflineResult,
    RSSMonitor,
    console,
    cpu_contention,
    machine_note,
    matmul_roofline,
    mib,
    print_table,
    process_peak_rss_bytes,
    progress,
    request_flops,
    resolve_device,
    run_main,
    set_threads,
    speculation_note,
    synchronize,
    write_json,
)
from bench.inputs import (
    chat_token_ids,
    load_azure_output_lengths,
    load_hf_model,
    load_hf_tokenizer,
    load_sharegpt_prompts,
    resolve_model,
)
from engine.profiling import STAGES, StepProfiler

GOAL_VS_HF_SINGLE = 10.0
GOAL_VS_HF_STATIC = 4.0
SAMPLING = "greedy (temperature 0), ignore_eos: every request emits exactly its drawn length"


class Workload(BaseModel):
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def size(self) -> int:
        return len(self.prompts)


class SystemResult(BaseModel):
    kind: str  # "hf_single" | "hf_static" | "ours"
    name: str
    num_requests: int  # the first `num_requests` of the workload were measured
    prompt_tokens: int
    output_tokens: int  # useful: each request's own length
    computed_output_tokens: int  # including padding decode steps a static batch wastes
    seconds: float
    peak_rss_bytes: int | None = None
    note: str = ""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def make_workload(
    tokenizer: Any, texts: Sequence[str], output_lens: Sequence[int], max_prompt_tokens: int | None = None
) -> Workload:
    """Pairs prompts (in file order, too-long ones skipped) with output lengths."""
    prompts: list[list[int]] = []
    for text in texts:
        if len(prompts) == len(output_lens):
            break
        ids = chat_token_ids(tokenizer, text)
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    if len(prompts) < len(output_lens):
        raise ValueError(f"only {len(prompts)} prompts fit, {len(output_lens)} requested")
    return Workload(prompts=prompts, output_lens=list(output_lens))


def _hf_generate(model: Any, input_ids: Any, attention_mask: Any, new_tokens: int, pad_id: int) -> Any:
    # min_new_tokens == max_new_tokens masks EOS until the end: HF's way to ignore EOS.
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        use_cache=True,
        pad_token_id=pad_id,
    )


def run_hf_single(model: Any, workload: Workload, limit: int | None, pad_id: int) -> SystemResult:
    """transformers, one request at a time, on the first `limit` requests."""
    import torch

    device = str(model.device)
    n = workload.size if limit is None else min(limit, workload.size)
    _hf_generate(model, torch.tensor([workload.prompts[0][:8]], device=device), None, 2, pad_id)  # warm-up
    useful = 0
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), progress(n, "hf one-at-a-time") as tick:
        for prompt, out_len in zip(workload.prompts[:n], workload.output_lens[:n], strict=True):
            ids = torch.tensor([prompt], device=device)
            out = _hf_generate(model, ids, torch.ones_like(ids), out_len, pad_id)
            useful += min(out_len, out.shape[1] - len(prompt))
            tick(1)
    synchronize(device)
    seconds = time.perf_counter() - t0
    return SystemResult(
        kind="hf_single",
        name="hf one-at-a-time",
        num_requests=n,
        prompt_tokens=sum(len(p) for p in workload.prompts[:n]),
        output_tokens=useful,
        computed_output_tokens=useful,
        seconds=seconds,
        note="" if n == workload.size else f"first {n} of {workload.size} requests",
    )


def run_hf_static(model: Any, workload: Workload, batch_size: int, pad_id: int) -> SystemResult:
    """transformers, static batches: left-padded, each batch decodes to its longest request."""
    import torch

    device = str(model.device)
    useful = computed = 0
    _hf_generate(model, torch.tensor([workload.prompts[0][:8]], device=device), None, 2, pad_id)  # warm-up
    batches = [range(i, min(i + batch_size, workload.size)) for i in range(0, workload.size, batch_size)]
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode(), progress(workload.size, f"hf static batches of {batch_size}") as tick:
        for batch in batches:
            prompts = [workload.prompts[i] for i in batch]
            lens = [workload.output_lens[i] for i in batch]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            out = _hf_generate(model, ids, mask, max(lens), pad_id)
            steps = out.shape[1] - width
            useful += sum(min(n, steps) for n in lens)
            computed += steps * len(prompts)
            tick(len(prompts))
    synchronize(device)
    return SystemResult(
        kind="hf_static",
        name=f"hf static batch {batch_size}",
        num_requests=workload.size,
        prompt_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=useful,
        computed_output_tokens=computed,
        seconds=time.perf_counter() - t0,
        note=f"{computed - useful:,} padded decode tokens not counted",
    )


def run_ours(llm: Any, workload: Workload) -> SystemResult:
    """Our engine, every request submitted at once in one `generate` call."""
    from engine import SamplingParams

    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([workload.prompts[0][:16]], warm, use_tqdm=False)
    llm.reset_prefix_cache()  # the warm-up must not pre-cache a request's prefix
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - t0
    useful = sum(min(len(o.token_ids), n) for o, n in zip(outs, workload.output_lens, strict=True))
    stats = llm.stats()
    return SystemResult(
        kind="ours",
        name="ours (all at once)",
        num_requests=workload.size,
        prompt_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=useful,
        computed_output_tokens=sum(len(o.token_ids) for o in outs),
        seconds=seconds,
        note=(
            f"preemptions {stats.num_preemptions}, prefix-cache hits "
            f"{stats.prefix_cache_hits:,}/{stats.prefix_cache_queries:,} prompt tokens, "
            f"{speculation_note(llm.engine.args.speculative_config)}"
        ),
    )


def load_ours(model: str, engine_args: dict[str, Any]) -> Any:
    from engine import LLM

    return LLM(model=model, **{k: v for k, v in engine_args.items() if v is not None})


class Report(BaseModel):
    workload: dict[str, Any]
    roofline: list[RooflineResult]
    results: list[SystemResult]
    gflops: dict[str, float]
    ratios: dict[str, float]
    process_peak_rss_bytes: int
    machine: list[str] = []  # at the start and at the end of the run
    contention_processes: int = 0  # CPU-bound competitors running through every measurement


def achieved_gflops(cfg: DecoderShape, workload: Workload, result: SystemResult) -> float:
    """Useful model FLOP/s: the measured requests' prompt and output tokens through the model."""
    n = result.num_requests
    flops = sum(
        request_flops(cfg, len(p), o)
        for p, o in zip(workload.prompts[:n], workload.output_lens[:n], strict=True)
    )
    return flops / result.seconds / 1e9


def report(
    cfg: DecoderShape, workload: Workload, results: list[SystemResult], roofline: list[RooflineResult]
) -> Report:
    by_kind = {r.kind: r for r in results}
    ours, single, static = by_kind.get("ours"), by_kind.get("hf_single"), by_kind.get("hf_static")
    ratios: dict[str, float] = {}
    if ours and single:
        ratios["ours/hf_single"] = ours.tokens_per_s / single.tokens_per_s
    if ours and static:
        ratios["ours/hf_static"] = ours.tokens_per_s / static.tokens_per_s
    for r in results:
        if r.kind.startswith("ours@"):
            if single:
                ratios[f"{r.kind}/hf_single"] = r.tokens_per_s / single.tokens_per_s
            if static:
                ratios[f"{r.kind}/hf_static"] = r.tokens_per_s / static.tokens_per_s
    return Report(
        workload={
            "num_requests": workload.size,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "output_tokens": sum(workload.output_lens),
            "sampling": SAMPLING,
        },
        roofline=roofline,
        results=results,
        gflops={r.name: achieved_gflops(cfg, workload, r) for r in results},
        ratios=ratios,
        process_peak_rss_bytes=process_peak_rss_bytes(),
    )


def print_report(rep: Report) -> None:
    peaks = {r.dtype: r.gflops for r in rep.roofline}
    cols = ["system", "requests", "useful out tok", "seconds", "useful tok/s", "model GFLOP/s"]
    cols += [f"% {d} peak" for d in peaks] + ["phase peak RSS MiB", "note"]
    rows = []
    for r in rep.results:
        g = rep.gflops[r.name]
        rows.append(
            [r.name, r.num_requests, r.output_tokens, r.seconds, r.tokens_per_s, g]
            + [100 * g / p for p in peaks.values()]
            + [mib(r.peak_rss_bytes) if r.peak_rss_bytes else None, r.note]
        )
    w = rep.workload
    print_table(
        "Offline throughput",
        cols,
        rows,
        caption=(
            f"{w['num_requests']} ShareGPT prompts ({w['prompt_tokens']:,} prompt tokens), Azure conv output "
            f"lengths ({w['output_tokens']:,} tokens); {w['sampling']}. Model GFLOP/s = 2 x matmul weights "
            "x (prompt + output tokens) + causal attention, useful requests only."
        ),
    )
    goals = {"ours/hf_single": GOAL_VS_HF_SINGLE, "ours/hf_static": GOAL_VS_HF_STATIC}
    if rep.ratios:
        print_table(
            "Speed-up (useful tokens/s)",
            ["ratio", "measured", "goal", "met"],
            [
                [k, v, f">= {goals[g]}x", "yes" if v >= goals[g] else "no"]
                for k, v in rep.ratios.items()
                for g in ["ours/" + k.split("/")[1]]
            ],
        )
    print_table(
        "Matmul roofline (same run)",
        ["dtype", "device", "size", "GFLOP/s"],
        [[r.dtype, r.device, f"{r.size}^3", r.gflops] for r in rep.roofline],
        caption=f"process peak RSS (ru_maxrss): {mib(rep.process_peak_rss_bytes):,.0f} MiB",
    )
    for line in rep.machine:
        console.print(line)


def print_step_split(prof: StepProfiler) -> None:
    ms = prof.per_step_ms()
    print_table(
        f"Ours: time per step by stage ({prof.steps} steps, mixed prefill and decode)",
        ["stage", "ms/step", "%"],
        [[s, ms[s], 100 * ms[s] / ms["total"] if ms["total"] else 0.0] for s in (*STAGES, "total")],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the output-length draw")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="skip longer ShareGPT prompts")
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours: running-batch limit")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours: tokens per step")
    p.add_argument("--kv-cache-mib", type=int, default=None, help="ours: KV pool size (default: engine's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="ours: disable prefix caching")
    p.add_argument("--dtype", default="auto", help="ours: auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--hf-dtype", default="float32")
    p.add_argument("--hf-single-requests", type=int, default=8, help="measure one-at-a-time on these")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf-single", action="store_true")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--roofline-size", type=int, default=2048)
    p.add_argument("--roofline-reps", type=int, default=3)
    p.add_argument("--weights", default=None, help="ours: fp32 | fp16 | bf16 | int8 | int4 | auto")
    p.add_argument(
        "--also-threads",
        type=int,
        nargs="*",
        default=[],
        help="ours: also run with torch threads pinned to each count (the tuner off), for comparison",
    )
    p.add_argument(
        "--also-weights",
        nargs="*",
        default=[],
        help="ours: also run with each of these weight formats (e.g. fp32), for comparison",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="ours: decode steps from CUDA graphs")
    p.add_argument(
        "--profile", action="store_true", help="ours: print the per-step time split (engine.profiling)"
    )
    p.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="run every system alongside N CPU-bound busy-loop processes (one core each)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the numbers here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with cpu_contention(args.contention) as competitors:
        if competitors:
            console.print(f"contention: {len(competitors)} CPU-bound busy loops (pids {competitors})")
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    texts = load_sharegpt_prompts()
    lens = load_azure_output_lengths(args.num_prompts, args.seed)
    model_path = resolve_model(args.model)
    device = resolve_device(args.device)
    threads = set_threads(args.threads)
    start_note = f"{machine_note(device, threads)}; model {model_path.name}"
    console.print(start_note)
    roofline = [
        matmul_roofline(d, args.roofline_size, args.roofline_reps, device) for d in ("float32", "bfloat16")
    ]
    tokenizer = load_hf_tokenizer(model_path)
    workload = make_workload(tokenizer, texts, lens, args.max_prompt_tokens)
    results: list[SystemResult] = []
    cfg: DecoderShape | None = None

    # Ours first, while the process holds no transformers model, so its phase RSS is its own.
    if not args.skip_ours:
        engine_args = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": False if args.no_prefix_caching else None,
            "kv_cache_memory": args.kv_cache_mib * 2**20 if args.kv_cache_mib else None,
            "dtype": args.dtype,
            "device": device,
            "weights": args.weights,
            "num_threads": args.threads,
            "cuda_graphs": True if args.cuda_graphs else None,
        }
        # Each pinned count in --also-threads (the tuner off) and each format in --also-weights
        # runs as one more "ours", same workload.
        extra = [(f"ours@{n}", f"ours ({n} threads pinned)", {"num_threads": n}) for n in args.also_threads]
        extra += [(f"ours@{w}", f"ours (weights {w})", {"weights": w}) for w in args.also_weights]
        for kind, name, override in [("ours", "", {}), *extra]:
            kw = {**engine_args, **override}
            with RSSMonitor() as mon:
                llm = load_ours(args.model, kw)
                console.print(f"{kind}: {speculation_note(llm.engine.args.speculative_config)}")
                prof = StepProfiler(llm.engine).attach() if args.profile and kind == "ours" else None
                res = run_ours(llm, workload)
                if prof is not None:
                    prof.detach()
                    print_step_split(prof)
            if kind != "ours":
                res = res.model_copy(update={"kind": kind, "name": name})
            results.append(res.model_copy(update={"peak_rss_bytes": mon.peak_bytes}))
            cfg = llm.model_config
            del llm
            gc.collect()

    if not (args.skip_hf_single and args.skip_hf_static):
        import torch

        torch.set_num_threads(threads)  # ours may have tuned it; transformers gets the default
        with RSSMonitor() as mon:
            model = load_hf_model(model_path, args.hf_dtype, device)
        cfg = cfg or model.config
        pad_id = tokenizer.eos_token_id  # pad = eos, as is usual for decoder-only batching
        if not args.skip_hf_single:
            with RSSMonitor() as mon:
                res = run_hf_single(model, workload, args.hf_single_requests, pad_id)
            results.append(res.model_copy(update={"peak_rss_bytes": mon.peak_bytes}))
        if not args.skip_hf_static:
            with RSSMonitor() as mon:
                res = run_hf_static(model, workload, args.hf_batch_size, pad_id)
            results.append(res.model_copy(update={"peak_rss_bytes": mon.peak_bytes}))

    if cfg is None:
        console.print("nothing to measure: every system was skipped")
        return 1
    rep = report(cfg, workload, results, roofline)
    rep.machine = [f"start: {start_note}", f"end: {machine_note(device, threads)}"]
    rep.contention_processes = args.contention
    print_report(rep)
    write_json(args.json_path, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
