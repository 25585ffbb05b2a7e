"""`--weights auto`: pick the linear-weight format by timing this machine's kernels at load.

One decoder layer's linears are run in each candidate format at batch 1 (what an interactive
stream pays) and at batch 64 (a full continuous batch), rounds interleaved so a load change
on a shared CPU hits every format alike. The format with the lowest geometric mean of its
time relative to fp32 over the two sizes wins. int4 is never chosen automatically: its
agreement with fp32 is lower (docs/engine.md "Weights"); ask for it explicitly.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import torch
from torch import nn

from engine.model.weights import convert_linears

log = logging.getLogger(__name__)

AUTO_CANDIDATES = ("fp32", "bf16", "int8")
BATCH_SIZES = (1, 64)
ROUNDS = 5


class _OneLayer(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])


def _linears(layer: nn.Module) -> list[nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


@torch.inference_mode()
def time_formats(model: nn.Module, formats: tuple[str, ...] = AUTO_CANDIDATES) -> dict[str, list[float]]:
    """Seconds per layer-linears pass, per format, at each of BATCH_SIZES."""
    base = model.layers[0]
    variants = {}
    for fmt in formats:
        holder = _OneLayer(copy.deepcopy(base))
        convert_linears(holder, fmt)
        variants[fmt] = _linears(holder.layers[0])
    hidden = base.self_attn.qkv_proj.in_features
    inter = base.mlp.down_proj.in_features
    dtype = base.self_attn.qkv_proj.weight.dtype
    q_size = base.self_attn.q_size
    inputs = {
        b: (
            torch.randn(b, hidden, dtype=dtype),
            torch.randn(b, q_size, dtype=dtype),
            torch.randn(b, inter, dtype=dtype),
        )
        for b in BATCH_SIZES
    }
    best: dict[str, list[float]] = {f: [math.inf] * len(BATCH_SIZES) for f in formats}
    for _ in range(ROUNDS):
        for fmt, (qkv, o, gate_up, down) in variants.items():
            for i, b in enumerate(BATCH_SIZES):
                x, a, y = inputs[b]
                t0 = time.perf_counter()
                qkv(x)
                o(a)
                gate_up(x)
                down(y)
                best[fmt][i] = min(best[fmt][i], time.perf_counter() - t0)
    return best


def choose_weights(model: nn.Module) -> str:
    times = time_formats(model)
    ref = times["fp32"]
    score = {f: math.prod(t / r for t, r in zip(ts, ref)) ** (1 / len(ref)) for f, ts in times.items()}
    fmt = min(score, key=score.get)
    log.info("weights auto: %s (time vs fp32 at batch %s: %s)", fmt, BATCH_SIZES, score)
    return fmt
