"""Decode-forward time of two checkouts of this repo, interleaved in one run.

On a shared CPU the load moves from minute to minute, so two trees timed one after the
other (or side by side, competing) do not compare. Here one worker process per tree loads
the model, captures a real decode step's inputs per batch size (`bench.compile_decode`),
and the driver lets them take turns: each round runs `--forwards` model forwards in one
tree, then in the other (order alternating), only one at a time. A tree's figure is its
median forward over all rounds.

    PYTHONPATH=. .venv/bin/python -m bench.forward_ab --before /tmp/main-checkout --after . \\
        --batch-sizes 1 8 --rounds 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import console, machine_note, print_table, run_main


def worker(model: str, batch_sizes: list[int], threads: int, forwards: int) -> None:
    """Child: answer each line `B` on stdin with the seconds of `forwards` forwards at B."""
    import torch

    from bench.compile_decode import capture_decode_inputs
    from bench.inputs import chat_token_ids, load_hf_tokenizer, load_sharegpt_prompts, resolve_model
    from engine import LLM

    tok = load_hf_tokenizer(resolve_model(model))
    prompts = [chat_token_ids(tok, t) for t in load_sharegpt_prompts()[:200]]
    prompts = [p for p in prompts if len(p) <= 96]
    llm = LLM(model=model, show_progress=False, num_threads=threads)
    inputs = {b: capture_decode_inputs(llm, b, prompts)[0] for b in batch_sizes}
    # the runner's buffers of the last capture stay valid: each capture's tensors are its own
    model_fn = llm.engine.runner.model
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        b = int(line)
        input_ids, positions, kv_caches, meta, logits_idx = inputs[b]
        times = []
        with torch.inference_mode():
            for _ in range(forwards):
                meta.rotary = meta.kv_write = meta.decode_plans = None
                t = time.perf_counter()
                model_fn(input_ids, positions, kv_caches, meta, logits_idx)
                times.append(time.perf_counter() - t)
        print(json.dumps({"times": times}), flush=True)


def start(tree: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    """A worker in `tree`: this file run by path (the before tree may not have it), with the
    tree's own packages first on the path."""
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    cmd = [sys.executable, "-c", run, __file__, "--worker", "--before", str(tree), "--model", args.model]
    cmd += ["--threads", str(args.threads), "--forwards", str(args.forwards)]
    cmd += ["--batch-sizes", *map(str, args.batch_sizes)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(proc: subprocess.Popen[str], line: str | None = None) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    out = proc.stdout.readline()
    if not out:
        raise RuntimeError(f"a worker exited (rc {proc.wait()})")
    return json.loads(out)


def median_ms(xs: list[float]) -> float:
    return 1000 * sorted(xs)[len(xs) // 2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="checkout timed as 'before'")
    p.add_argument("--after", type=Path, default=Path("."), help="checkout timed as 'after'")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--forwards", type=int, default=5, help="forwards per tree per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.model, args.batch_sizes, args.threads, args.forwards)
        return 0
    console.print(machine_note("cpu", args.threads))
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    procs = {name: start(tree, args) for name, tree in trees.items()}
    try:
        for proc in procs.values():
            ask(proc)  # ready
        times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in procs for b in args.batch_sizes}
        for r in range(args.rounds):
            order = list(procs) if r % 2 == 0 else list(reversed(procs))
            for b in args.batch_sizes:
                for name in order:
                    times[(name, b)] += ask(procs[name], str(b))["times"]
        rows = []
        for b in args.batch_sizes:
            before, after = median_ms(times[("before", b)]), median_ms(times[("after", b)])
            rows.append([b, before, after, f"{before / after:.2f}x"])
        print_table(
            f"Decode forward, median ms ({args.rounds} rounds x {args.forwards} forwards, interleaved)",
            ["B", "before ms", "after ms", "speed-up"],
            rows,
        )
        console.print(f"end: {machine_note('cpu', args.threads)}")
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
