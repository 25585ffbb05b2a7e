"""Where one engine step's time goes, at steady-state decode batch sizes.

For each batch size B: B real ShareGPT prompts are prefilled, then `--steps` decode steps
(every sequence decoding, greedy, ignore_eos) are timed stage by stage with
`engine.profiling.StepProfiler`, and a few more under `torch.profiler` count the tensor
allocations per step.

    PYTHONPATH=. .venv/bin/python -m bench.profile_step --batch-sizes 1 8 32 64
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel

from bench.common import batch_sweep_parser, console, machine_note, print_table, run_main, set_threads
from bench.inputs import chat_token_ids, load_hf_tokenizer, load_sharegpt_prompts, resolve_model
from engine.profiling import STAGES, StepProfiler


class StepProfile(BaseModel):
    batch_size: int
    steps: int
    ms: dict[str, float]  # per step, by stage, plus "total"
    allocs_per_step: float
    alloc_mib_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch_size / self.ms["total"] if self.ms["total"] else 0.0


def count_allocations(engine: Any, steps: int) -> tuple[float, float]:
    """Tensor allocations (count, MiB) per step over `steps` steps, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            engine.step()
    allocs = [e for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage > 0]
    return len(allocs) / steps, sum(e.cpu_memory_usage for e in allocs) / steps / 2**20


def count_ops(engine: Any, steps: int) -> list[tuple[str, float, float]]:
    """(op, calls per step, self CPU ms per step) over `steps` steps, most calls first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    rows = [(e.key, e.count / steps, e.self_cpu_time_total / 1000 / steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])


def profile_batch(
    llm: Any, prompts: list[list[int]], batch_size: int, steps: int, ops: int = 0
) -> StepProfile:
    from engine import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch_size)]
    ids = [eng.add_request(p, params) for p in chosen]
    # Prefill everything (and a few warm decode steps) before measuring decode.
    while len(eng.scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running
    ):
        eng.step()
    for _ in range(3):
        eng.step()
    prof = StepProfiler(eng).attach()
    try:
        for _ in range(steps):
            eng.step()
    finally:
        prof.detach()
    allocs, alloc_mib = count_allocations(eng, min(2, steps))
    if ops:
        table = count_ops(eng, min(3, steps))
        print_table(
            f"B={batch_size}: ops per decode step (torch.profiler, {sum(r[1] for r in table):.0f} in all)",
            ["op", "calls/step", "self CPU ms/step"],
            [list(r) for r in table[:ops]],
        )
    for rid in ids:
        eng.abort_request(rid)
    llm.reset_prefix_cache()
    return StepProfile(
        batch_size=batch_size,
        steps=prof.steps,
        ms=prof.per_step_ms(),
        allocs_per_step=allocs,
        alloc_mib_per_step=alloc_mib,
    )


def print_profiles(profiles: list[StepProfile], title: str) -> None:
    cols = ["stage"] + [f"B={p.batch_size} ms" for p in profiles]
    rows: list[list[Any]] = [[s] + [p.ms[s] for p in profiles] for s in STAGES]
    rows.append(["total"] + [p.ms["total"] for p in profiles])
    rows.append(["decode tok/s"] + [p.tokens_per_s for p in profiles])
    rows.append(["allocations/step"] + [p.allocs_per_step for p in profiles])
    rows.append(["alloc MiB/step"] + [p.alloc_mib_per_step for p in profiles])
    print_table(title, cols, rows)


def run_profiles(
    llm: Any, prompts: list[list[int]], batch_sizes: list[int], steps: int, ops: int = 0
) -> list[StepProfile]:
    out = []
    for b in batch_sizes:
        out.append(profile_batch(llm, prompts, b, steps, ops))
        p = out[-1]
        console.print(
            f"B={b}: {p.ms['total']:.1f} ms/step " + ", ".join(f"{k} {v:.1f}" for k, v in p.ms.items())
        )
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = batch_sweep_parser(__doc__)
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--weights", default=None, help="ours: fp32 | fp16 | bf16 | int8 | int4 | auto")
    p.add_argument("--threads", type=int, default=None, help="pin torch threads (default: tuned)")
    p.add_argument("--ops", type=int, default=0, help="also list the N most called ops per step")
    p.add_argument("--json", dest="json_path", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from engine import LLM

    args = parse_args(argv)
    model_path = resolve_model(args.model)
    threads = set_threads(args.threads)
    tok = load_hf_tokenizer(model_path)
    prompts = [chat_token_ids(tok, t) for t in load_sharegpt_prompts()[:200]]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    extra: dict[str, Any] = {"weights": args.weights} if args.weights else {}
    if args.threads is not None:
        extra["num_threads"] = args.threads  # pinned: the engine's tuner is off
    llm = LLM(model=args.model, show_progress=False, **extra)
    console.print(machine_note("cpu", threads))
    profiles = run_profiles(llm, prompts, args.batch_sizes, args.steps, args.ops)
    print_profiles(profiles, f"Decode step profile ({args.steps} steps each)")
    console.print(f"end: {machine_note('cpu', threads)}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            f.write("[" + ",".join(p.model_dump_json() for p in profiles) + "]")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
