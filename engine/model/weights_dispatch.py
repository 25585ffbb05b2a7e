"""Linears that hold more than one weight format and pick one by the number of rows M.

A decode step multiplies a few rows by every weight (bytes per weight bound it: fp16 wins);
a prefill chunk multiplies hundreds (MKL's fp32 sgemm wins on this CPU). A `Plan` maps M to a
format; `plan_from_timings` is the pure choice from measured seconds (`weights_choice` times
the kernels at load), so the same policy can be tested on given timings.

The fp32 copy next to an fp16 one is rounded to fp16 values in place: both kernels then
multiply by the same numbers and differ only in summation order, so which kernel a step ran
(how many rows its batch had) does not change a request's result beyond what any two BLAS
paths do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.weights import Fp16Linear, decoder_linears

# (largest M served, format), M ascending; the last entry (None) serves every larger M.
Plan = tuple[tuple[int | None, str], ...]
DISPATCH_FORMATS = ("fp32", "fp16")
MARGIN = 0.05  # fp16 takes a bucket only if it saves at least this much (geometric mean over M)


def plan_from_timings(
    timings: Mapping[str, Mapping[int, float]],
    small: str = "fp16",
    large: str = "fp32",
    margin: float = MARGIN,
) -> Plan:
    """`small` for M up to one crossover, `large` above: the crossover whose geometric mean
    time vs `large` over the measured M is lowest (all `large` unless that gains `margin`).

    One crossover, not a free choice per M: fewer bytes per weight win while a product is
    memory-bound (few rows) and stop winning once it is compute-bound, and on a shared CPU a
    single noisy sample must not carve out a bucket of its own. M between two measured sizes
    goes with the larger one.
    """
    sizes = sorted(timings[large])
    logs = [math.log(timings[small][m] / timings[large][m]) for m in sizes]
    best_n, best = 0, 0.0
    for n in range(1, len(sizes) + 1):  # the first n measured sizes take `small`
        score = sum(logs[:n]) / len(sizes)
        if score < best:
            best_n, best = n, score
    if best_n == 0 or best > math.log(1 - margin):
        return ((None, large),)
    if best_n == len(sizes):
        return ((None, small),)
    return ((sizes[best_n - 1], small), (None, large))


def formats_of(plan: Plan) -> set[str]:
    return {fmt for _, fmt in plan}


def describe(plan: Plan) -> str:
    """ "fp16" / "fp16 for M<=16, fp32 above" — for the startup log line and docs."""
    if len(plan) == 1:
        return plan[0][1]
    return ", ".join(f"{fmt} for M<={high}" if high is not None else f"{fmt} above" for high, fmt in plan)


def pick(plan: Plan, m: int) -> str:
    for high, fmt in plan:
        if high is None or m <= high:
            return fmt
    return plan[-1][1]


class DispatchLinear(nn.Module):
    """One linear, several kernels: each call runs the plan's format for its row count."""

    def __init__(self, kernels: Mapping[str, nn.Module], plan: Plan) -> None:
        super().__init__()
        self.kernels = nn.ModuleDict(dict(kernels))
        self.plan = plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels[pick(self.plan, x.numel() // x.shape[-1])](x)


class FloatHead(nn.Module):
    """`F.linear` by a weight owned elsewhere (the tied embedding's), not registered twice."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self._weight = [weight]  # a list keeps it out of parameters() and state_dict()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._weight[0])


@torch.no_grad()
def round_to_fp16_(weight: torch.Tensor) -> None:
    """Round to the nearest fp16 value, in place (strides kept: column-major stays so)."""
    weight.copy_(weight.to(torch.float16).to(weight.dtype))


def dispatched(linear: nn.Linear, plan: Plan) -> nn.Module:
    """The module serving `linear` under `plan`: itself, its fp16 copy, or both."""
    fmts = formats_of(plan)
    if fmts == {"fp32"}:
        return linear
    if fmts == {"fp16"}:
        return Fp16Linear.of(linear)  # the fp32 weight is dropped with the old module
    round_to_fp16_(linear.weight)
    return DispatchLinear({"fp32": linear, "fp16": Fp16Linear.of(linear)}, plan)


def apply_linear_plan(model: nn.Module, plan: Plan, workers: int = 1) -> int:
    """Every decoder linear served under `plan`; returns how many hold an fp16 copy.

    fbgemm packs on one thread (seconds for a 135M model), and the packing releases the GIL
    for much of it, so `workers` threads pack linears side by side."""
    found = decoder_linears(model)
    inference = torch.is_inference_mode_enabled()  # thread-local: the workers take the caller's

    def build(linear: nn.Linear) -> nn.Module:
        with torch.inference_mode(inference):
            return dispatched(linear, plan)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        modules = list(pool.map(build, [linear for _, _, linear in found]))
    for (parent, name, _), module in zip(found, modules):
        setattr(parent, name, module)
    return len(found) if "fp16" in formats_of(plan) else 0


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if head is None else head.weight


def lm_head_for(weight: torch.Tensor, plan: Plan, fp16: Fp16Linear | None = None) -> nn.Module | None:
    """The logits head under `plan` (None: the model's own fp32 product), reusing `fp16` if
    given. The embedding lookup keeps its exact fp32 rows; a rounded fp32 copy is made only
    if the plan mixes formats."""
    fmts = formats_of(plan)
    if fmts == {"fp32"}:
        return None
    fp16 = fp16 or Fp16Linear(weight)
    if fmts == {"fp16"}:
        return fp16
    rounded = weight.detach().to(torch.float16).to(weight.dtype).t().contiguous().t()
    return DispatchLinear({"fp32": FloatHead(rounded), "fp16": fp16}, plan)


def convert_lm_head(model: nn.Module, plan: Plan, fp16: Fp16Linear | None = None) -> None:
    """Install the logits head (`model.logits_head`, read by the model's forward)."""
    model.logits_head = lm_head_for(lm_head_weight(model), plan, fp16)
