"""One decoder layer's linears (q/k/v, o, gate/up, down) of the real model in each weight
format, at batch 1 and 64, per thread count: the measurement `--weights auto` makes at load.

    PYTHONPATH=. .venv/bin/python -m bench.weights_speed
"""

from __future__ import annotations

import argparse

import torch

from bench.common import console, machine_note, print_table, run_main
from engine.model.weights import FORMATS
from engine.model.weights_choice import BATCH_SIZES, time_formats
from engine.threads import available_cpus


def main(argv: list[str] | None = None) -> int:
    from engine import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    llm = LLM(model=args.model, show_progress=False, num_threads=1)
    rows = []
    for threads in sorted({1, available_cpus()}):
        torch.set_num_threads(threads)
        times = time_formats(llm.engine.runner.model, FORMATS)
        for fmt, ts in times.items():
            rel = [t / r for t, r in zip(ts, times["fp32"])]
            rows.append([threads, fmt, *(1e3 * t for t in ts), *rel])
    print_table(
        "One layer's linears by weight format (best of 5 interleaved rounds)",
        ["threads", "weights", *(f"B={b} ms" for b in BATCH_SIZES), *(f"B={b} vs fp32" for b in BATCH_SIZES)],
        rows,
    )
    console.print(machine_note("cpu", torch.get_num_threads()))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
