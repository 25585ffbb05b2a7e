"""`--weights auto`: per batch size, the linear-weight format measured fastest here, at load.

The candidates (`candidates()`) are fp32 (MKL, column-major) and fbgemm fp16, the formats
that keep transformers' greedy tokens within the near-tie tolerance (docs/engine.md
"Weights"). bf16 (oneDNN, fast only where the CPU has AVX512_BF16 or AMX) does not, so it is
opt-in: `FLEET_WEIGHTS_AUTO_CANDIDATES=fp32,fp16,bf16` sets the set. The decoder linears of
the first `TIMED_LAYERS` layers (distinct weights, more than the last-level cache holds, so
they stream from memory as in a real step) and the LM head are timed in each candidate at several row counts M, rounds
interleaved so a load change on a shared CPU hits every format alike; `plan_from_timings`
then picks a format per M bucket. int8 (dynamic, batch-dependent) and int4 are never
chosen automatically. Each format's time is its best over the thread counts the step tuner
may use (engine.threads). A process measures a given shape, thread count and candidate set once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.model import weights_plan_cache
from engine.model.weights import Bf16Linear, Fp16Linear, decoder_linears, linear_in
from engine.model.weights_dispatch import (
    DISPATCH_FORMATS,
    FloatHead,
    Plan,
    apply_linear_plan,
    convert_lm_head,
    describe,
    lm_head_weight,
    plan_from_timings,
)
from engine.threads import available_cpus

log = logging.getLogger(__name__)

LINEAR_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
HEAD_SIZES = (1, 8, 64)
TIMED_LAYERS = 2
ROUNDS = 2

Timings = dict[str, dict[int, float]]
CANDIDATES_ENV = "FLEET_WEIGHTS_AUTO_CANDIDATES"


# bf16 is opt-in: on the correctness set it departs from transformers' greedy tokens beyond
# the near-tie tolerance fp32 and fp16 keep (docs/engine.md "Weights").
DEFAULT_CANDIDATES = ("fp32", "fp16")


def native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512_BF16, AMX-BF16)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def candidates(env: str | None = None) -> tuple[str, ...]:
    """The formats auto times, in DISPATCH_FORMATS order: `FLEET_WEIGHTS_AUTO_CANDIDATES`
    (comma-separated) if set, else DEFAULT_CANDIDATES."""
    raw = os.environ.get(CANDIDATES_ENV) if env is None else env
    if raw is None or not raw.strip():
        return DEFAULT_CANDIDATES
    asked = {f.strip().lower() for f in raw.split(",") if f.strip()}
    unknown = sorted(asked - set(DISPATCH_FORMATS))
    if unknown:
        raise ValueError(
            f"{CANDIDATES_ENV}: unknown format(s) {', '.join(unknown)}; auto chooses among "
            f"{', '.join(DISPATCH_FORMATS)}"
        )
    return tuple(f for f in DISPATCH_FORMATS if f in asked)


@dataclass(frozen=True)
class AutoChoice:
    linears: Plan
    lm_head: Plan
    linear_s: Timings
    head_s: Timings

    def summary(self) -> str:
        return f"linears {describe(self.linears)}; LM head {describe(self.lm_head)}"


_MEASURED: dict[tuple, AutoChoice] = {}


@torch.inference_mode()
def time_kernels(
    kernels: Mapping[str, Sequence[nn.Module]], sizes: Sequence[int], rounds: int = ROUNDS
) -> Timings:
    """Seconds for one pass over each format's kernels at each M, best of interleaved rounds.
    Every format's kernel list is in the same order, with the same input widths."""
    first = next(iter(kernels.values()))
    widths = [k.in_features for k in first]
    inputs = {m: {w: torch.randn(m, w) for w in set(widths)} for m in sizes}
    best = {fmt: dict.fromkeys(sizes, math.inf) for fmt in kernels}
    for r in range(rounds + 1):  # round 0 warms up (first-call allocations, packing caches)
        for m in sizes:
            for fmt, ks in kernels.items():
                t0 = time.perf_counter()
                for k, w in zip(ks, widths):
                    k(inputs[m][w])
                if r:
                    best[fmt][m] = min(best[fmt][m], time.perf_counter() - t0)
    return best


def best_over_threads(kernels: Mapping[str, Sequence[nn.Module]], sizes: Sequence[int]) -> Timings:
    """Each format's best time over the thread counts the step tuner may pick (all cores, one):
    the tuner runs each step at its fastest count, and on a contended CPU fbgemm's kernels
    lose several-fold with two threads where MKL's small products do not."""
    previous = torch.get_num_threads()
    counts = sorted({previous, available_cpus(), 1})
    try:
        per = []
        for n in counts:
            torch.set_num_threads(n)
            per.append(time_kernels(kernels, sizes))
    finally:
        torch.set_num_threads(previous)
    return {f: {m: min(t[f][m] for t in per) for m in sizes} for f in kernels}


def layer_kernels(model: nn.Module, formats: Sequence[str], layers: int | None = TIMED_LAYERS) -> dict:
    """The first `layers` decoder layers' linears in each format (fp32: the model's own)."""
    linears = [lin for _, _, lin in decoder_linears(model)]
    per_layer = len(linears) // len(model.layers)
    linears = linears if layers is None else linears[: layers * per_layer]
    return {fmt: [linear_in(fmt, lin) for lin in linears] for fmt in formats}


def head_kernels(model: nn.Module, formats: Sequence[str] = ("fp32", "fp16")) -> dict:
    """The LM head in each format, one kernel each (fp32: the tied weight itself)."""
    weight = lm_head_weight(model)
    build = {
        "fp32": lambda: _Sized(FloatHead(weight), weight.shape[1]),
        "fp16": lambda: Fp16Linear(weight),
        "bf16": lambda: Bf16Linear(weight),
    }
    return {f: [build[f]()] for f in formats}


class _Sized(nn.Module):
    def __init__(self, inner: nn.Module, in_features: int) -> None:
        super().__init__()
        self.inner, self.in_features = inner, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _key(model: nn.Module, formats: tuple[str, ...]) -> tuple:
    shapes = tuple(tuple(lin.weight.shape) for _, _, lin in decoder_linears(model)[:8])
    return shapes, tuple(lm_head_weight(model).shape), len(model.layers), torch.get_num_threads(), formats


def measure(model: nn.Module) -> tuple[AutoChoice, Fp16Linear | None]:
    """Once per process, shape and candidate set; across processes through the on-disk plan
    cache. A single candidate is the plan, without timing. Also returns the fp16 LM head
    packed for timing, if one was, so installing the plan does not pack it again (and a
    remembered plan packs it only if it uses it)."""
    formats = candidates()
    key = _key(model, formats)
    if "bf16" in formats and not native_bf16():
        log.warning("weights auto: bf16 is emulated on this CPU (no AVX512_BF16 or AMX); timing it anyway")
    if len(formats) == 1:
        return AutoChoice(((None, formats[0]),), ((None, formats[0]),), {}, {}), None
    head_fp16 = None
    if key not in _MEASURED:
        disk_key = weights_plan_cache.machine_key((key, LINEAR_SIZES, HEAD_SIZES, TIMED_LAYERS))
        choice = _from_record(weights_plan_cache.load(disk_key))
        if choice is None:
            t0 = time.perf_counter()
            lin = best_over_threads(layer_kernels(model, formats), LINEAR_SIZES)
            heads = head_kernels(model, formats)
            head_fp16 = heads["fp16"][0] if "fp16" in heads else None
            head = best_over_threads(heads, HEAD_SIZES)
            choice = AutoChoice(plan_from_timings(lin), plan_from_timings(head), lin, head)
            log.debug("weights auto measured in %.2fs", time.perf_counter() - t0)
            weights_plan_cache.store(disk_key, _to_record(choice))
        _MEASURED[key] = choice
    return _MEASURED[key], head_fp16


def _to_record(choice: AutoChoice) -> dict:
    return {
        "linears": [list(step) for step in choice.linears],
        "lm_head": [list(step) for step in choice.lm_head],
        "linear_s": {f: {str(m): t for m, t in ts.items()} for f, ts in choice.linear_s.items()},
        "head_s": {f: {str(m): t for m, t in ts.items()} for f, ts in choice.head_s.items()},
    }


def _from_record(record: dict | None) -> AutoChoice | None:
    """None for a missing record or one this version cannot use (it is then measured again)."""
    if not record:
        return None
    try:
        plans = [
            tuple((None if high is None else int(high), str(fmt)) for high, fmt in record[name])
            for name in ("linears", "lm_head")
        ]
        if not all(plans) or any(fmt not in DISPATCH_FORMATS for plan in plans for _, fmt in plan):
            return None
        times = [
            {f: {int(m): float(t) for m, t in ts.items()} for f, ts in record[name].items()}
            for name in ("linear_s", "head_s")
        ]
    except (KeyError, TypeError, ValueError):
        return None
    return AutoChoice(plans[0], plans[1], times[0], times[1])


def apply_auto(model: nn.Module) -> AutoChoice:
    """Measure (once per process and shape), then serve every linear and the LM head by plan."""
    choice, head_fp16 = measure(model)
    apply_linear_plan(model, choice.linears, workers=available_cpus())
    convert_lm_head(model, choice.lm_head, head_fp16)
    ms = {f: {m: round(1e3 * t, 2) for m, t in ts.items()} for f, ts in choice.linear_s.items()}
    log.info("weights auto: %s (ms for %d layers' linears by M: %s)", choice.summary(), TIMED_LAYERS, ms)
    return choice
