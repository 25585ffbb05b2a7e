"""Linears that hold more than one weight format and pick one by the number of rows M.

A decode step multiplies a few rows by every weight (bytes per weight bound it: fp16 wins);
a prefill chunk multiplies hundreds (MKL's fp32 sgemm wins on this CPU; bf16 may, on a CPU
that multiplies bf16 natively). A `Plan` maps M to a format; `plan_from_timings` is the pure choice from measured seconds (`weights_choice` times
the kernels at load), so the same policy can be tested on given timings.

The fp32 copy next to an fp16 one is rounded to fp16 values in place: both kernels then
multiply by the same numbers and differ only in summation order, so which kernel a step ran
(how many rows its batch had) does not change a request's result beyond what any two BLAS
paths do. A bf16 kernel rounds weights and activations to bf16, which no rounding of the
other copies could match, so the others keep their precision and the M range bf16 serves
differs from them by bf16 rounding (docs/engine.md "Weights" has its agreement figure).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.weights import Bf16Linear, Fp16Linear, decoder_linears

# (largest M served, format), M ascending; the last entry (None) serves every larger M.
Plan = tuple[tuple[int | None, str], ...]
DISPATCH_FORMATS = ("fp32", "fp16", "bf16")
BASELINE = "fp32"
# The order formats take ranges of M in: fewest bytes per weight while memory-bound, then
# MKL's fp32, then bf16's compute-bound GEMM.
M_ORDER = ("fp16", "fp32", "bf16")
MARGIN = 0.05  # each format beside the baseline must save this much (geometric mean over M)


def plan_from_timings(timings: Mapping[str, Mapping[int, float]], margin: float = MARGIN) -> Plan:
    """The plan with the lowest geometric mean time vs the baseline over the measured M, each
    format serving one contiguous range of M, the ranges in M_ORDER.

    Fewer bytes per weight (fp16) win while a product is memory-bound (few rows); fp32, or
    bf16 where the CPU multiplies it natively, once it is compute-bound. One range per
    format in a fixed order, not a free choice per M, so a single noisy sample on a shared
    CPU cannot carve out a bucket of its own; and every format used beside the baseline (fp32
    if timed, else the first in M_ORDER) must lower the geometric mean by `margin`, or the
    plan keeps fewer formats. Ties go to fewer formats. M between two measured sizes goes
    with the larger one.
    """
    formats = sorted(timings, key=lambda f: M_ORDER.index(f) if f in M_ORDER else len(M_ORDER))
    base = BASELINE if BASELINE in timings else formats[0]
    sizes = sorted(timings[base])
    logs = {f: [math.log(timings[f][m] / timings[base][m]) for m in sizes] for f in formats}
    penalty = -math.log(1 - margin)
    best: tuple[float, int, tuple[int, ...]] | None = None
    best_plan: Plan = ((None, base),)
    for k in range(1, min(len(formats), len(sizes)) + 1):
        for order in itertools.combinations(range(len(formats)), k):  # ranges in M_ORDER
            for cuts in itertools.combinations(range(1, len(sizes)), k - 1):
                bounds = (0, *cuts, len(sizes))
                score = sum(
                    sum(logs[formats[f]][bounds[i] : bounds[i + 1]]) for i, f in enumerate(order)
                ) / len(sizes)
                extra = sum(formats[f] != base for f in order)
                key = (round(score + penalty * extra, 12), k, order)
                if best is None or key < best:
                    best = key
                    best_plan = tuple(
                        (None if i == k - 1 else sizes[bounds[i + 1] - 1], formats[f])
                        for i, f in enumerate(order)
                    )
    return best_plan


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
        # The last row count's choice: every linear of a step sees the same M, so the plan is
        # looked up once per step, not once per call.
        self._last: tuple[int, nn.Module] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.numel() // x.shape[-1]
        last = self._last
        if last is None or last[0] != m:
            last = self._last = (m, self.kernels[pick(self.plan, m)])
        return last[1].forward(x)


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


_LOW_PRECISION = {"fp16": Fp16Linear, "bf16": Bf16Linear}


def kernels_for(weight: torch.Tensor, plan: Plan, fp16: Fp16Linear | None = None) -> nn.Module:
    """A bias-free product (the LM head) under a plan that uses a lower-precision format: one
    kernel, or a DispatchLinear over several; beside fp16 the fp32 kernel gets its own copy
    rounded to fp16 values (`weight` itself is left as it is). `fp16` is reused if given."""
    fmts = formats_of(plan)
    w = weight.detach()
    if {"fp32", "fp16"} <= fmts:
        w = w.to(torch.float16).to(weight.dtype).t().contiguous().t()
    kernels: dict[str, nn.Module] = {}
    for f in fmts:
        if f == "fp32":
            kernels[f] = FloatHead(w)
        else:
            kernels[f] = fp16 if f == "fp16" and fp16 is not None else _LOW_PRECISION[f](w)
    return next(iter(kernels.values())) if len(kernels) == 1 else DispatchLinear(kernels, plan)


def dispatched(linear: nn.Linear, plan: Plan) -> nn.Module:
    """The module serving `linear` under `plan`: itself, or its copies in the plan's formats
    (beside an fp16 copy the fp32 weight is rounded to fp16 values in place)."""
    fmts = formats_of(plan)
    if fmts == {"fp32"}:
        return linear
    if len(fmts) == 1:  # the fp32 weight is dropped with the old module
        return _LOW_PRECISION[next(iter(fmts))].of(linear)
    if {"fp32", "fp16"} <= fmts:
        round_to_fp16_(linear.weight)
    return DispatchLinear({f: linear if f == "fp32" else _LOW_PRECISION[f].of(linear) for f in fmts}, plan)


def apply_linear_plan(model: nn.Module, plan: Plan, workers: int = 1) -> int:
    """Every decoder linear served under `plan`; returns how many hold a lower-precision copy.

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
    return len(found) if formats_of(plan) - {"fp32"} else 0


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if head is None else head.weight


def lm_head_for(weight: torch.Tensor, plan: Plan, fp16: Fp16Linear | None = None) -> nn.Module | None:
    """The logits head under `plan` (None: the model's own fp32 product), reusing `fp16` if
    given. The embedding lookup keeps its exact fp32 rows; a rounded fp32 copy is made only
    if the plan mixes formats."""
    if formats_of(plan) == {"fp32"}:
        return None
    return kernels_for(weight, plan, fp16)


def convert_lm_head(model: nn.Module, plan: Plan, fp16: Fp16Linear | None = None) -> None:
    """Install the logits head (`model.logits_head`, read by the model's forward)."""
    model.logits_head = lm_head_for(lm_head_weight(model), plan, fp16)
