"""The real model's decoder linears (q/k/v, o, gate/up, down of `--layers` layers, distinct
weights, so they stream from memory as in a step) and its LM head in each weight format, at
several row counts M, best of interleaved rounds: the measurement `--weights auto` makes at
load, widened to every format, and the plans auto would pick from it: with its default
candidates on this CPU, and with bf16 among them.

    PYTHONPATH=. .venv/bin/python -m bench.weights_speed --layers 30
"""

from __future__ import annotations

import argparse

import torch

from bench.common import console, machine_note, print_table, run_main
from engine.model.weights import FORMATS, Int8Linear
from engine.model.weights_choice import candidates, head_kernels, layer_kernels, time_kernels
from engine.model.weights_dispatch import DISPATCH_FORMATS, describe, lm_head_weight, plan_from_timings
from engine.threads import available_cpus

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Int8Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.inner = Int8Linear(_as_linear(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    return lin


def main(argv: list[str] | None = None) -> int:
    from engine import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=8, help="decoder layers timed (weights from memory)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="row counts M")
    p.add_argument("--formats", nargs="+", default=[f for f in FORMATS if f != "int4"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=available_cpus())
    args = p.parse_args(argv)
    llm = LLM(model=args.model, weights="fp32", show_progress=False, num_threads=args.threads)
    model = llm.engine.runner.model
    torch.set_num_threads(args.threads)
    formats = ["fp32", *(f for f in args.formats if f != "fp32")]
    lin = time_kernels(layer_kernels(model, formats, args.layers), args.sizes, args.rounds)
    head_formats = [f for f in ("fp32", "fp16", "bf16") if f in formats]
    head_k = head_kernels(model, head_formats)
    head_k["int8"] = [_Int8Head(lm_head_weight(model))]
    head = time_kernels(head_k, args.sizes, args.rounds)
    rows = []
    for m in args.sizes:
        rows.append(
            [m, *(1e3 * lin[f][m] for f in formats), *(1e3 * head[f][m] for f in (*head_formats, "int8"))]
        )
    print_table(
        f"ms per step: {args.layers} layers' linears by format, and the LM head ({args.threads} threads, "
        f"best of {args.rounds} interleaved rounds)",
        ["M", *formats, *(f"LM {f}" for f in (*head_formats, "int8"))],
        rows,
    )
    default = candidates()
    for name, cands in (
        ("default candidates " + ",".join(default), default),
        ("with bf16", DISPATCH_FORMATS),
    ):
        if all(f in lin for f in cands):
            console.print(
                f"auto's plan ({name}): linears {describe(plan_from_timings({f: lin[f] for f in cands}))}; "
                f"LM head {describe(plan_from_timings({f: head[f] for f in cands}))}"
            )
    console.print(machine_note("cpu", args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
