"""Triton fused RMSNorm (+ residual add) and in-place rotary embedding.

Both are memory-bound and launched once per layer, so each is one pass over its rows:
RMSNorm reads x (and the residual) once and writes the normalized row (and the new
residual); rotary rotates every head of a token's q and k in the same program. A program
takes several rows / tokens when rows are short, and many in Triton's interpreter, whose
cost is per program and per operation rather than per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_mode import interpreter_active


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    eps,
    num_rows,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program = ROWS rows; the sum of squares is taken in float32."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        summed = (x + r.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + rows[:, None] * stride_nr + cols[None, :], summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = x * inv_rms[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """One program = TOKENS tokens: rotate-half over the first 2 * HALF dims of every q and k head."""
    token = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    t_mask = token < num_tokens
    pos = tl.load(positions_ptr + token, mask=t_mask, other=0).to(tl.int64)
    h = tl.arange(0, HALF_PAD)
    h_mask = h < HALF
    cs_mask = t_mask[:, None] & h_mask[None, :]
    cs_row = cos_sin_ptr + pos[:, None] * stride_cs + h[None, :]
    cos = tl.load(cs_row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cs_row + HALF, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]

    heads = tl.arange(0, Q_HEADS_PAD)
    mask = t_mask[:, None, None] & (heads < num_q_heads)[None, :, None] & h_mask[None, None, :]
    first = q_ptr + token[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + h[None, None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    heads = tl.arange(0, KV_HEADS_PAD)
    mask = t_mask[:, None, None] & (heads < num_kv_heads)[None, :, None] & h_mask[None, None, :]
    first = k_ptr + token[:, None, None] * stride_kt + heads[None, :, None] * stride_kh + h[None, None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


def rows_per_program(rows: int, row_elements: int, gpu_budget: int = 2048) -> int:
    """Rows a program handles: enough for ~`gpu_budget` elements on a GPU; up to 64 rows interpreted."""
    budget = 65536 if interpreter_active() else gpu_budget
    per_program = max(1, budget // max(1, row_elements))
    return max(1, min(triton.next_power_of_2(max(rows, 1)), triton.next_power_of_2(per_program + 1) // 2, 64))


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """Same contract as `kernels.reference.rms_norm`; any leading dims, contiguous last dim."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    num_rows = x2d.shape[0]
    if residual is not None:
        r2d = residual.reshape(-1, hidden)
        new_residual = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    else:
        r2d = new_residual = x2d  # unused
    if num_rows:
        if x2d.stride(-1) != 1 or r2d.stride(-1) != 1 or weight.stride(-1) != 1:
            raise ValueError("rms_norm needs a contiguous last dimension")
        block = triton.next_power_of_2(hidden)
        rows = rows_per_program(num_rows, block)
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x2d,
            r2d,
            weight,
            out,
            new_residual,
            float(eps),
            num_rows,
            hidden,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            new_residual.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROWS=rows,
            BLOCK=block,
            num_warps=min(16, max(1, rows * block // 256)),
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, new_residual.view(x.shape)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor, cos_sin_cache: Tensor) -> None:
    """Same contract as `kernels.reference.rotary_embedding`: q [T, Hq, D], k [T, Hkv, D] in place."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension on q, k and the cache")
    half = cos_sin_cache.shape[1] // 2
    half_pad = triton.next_power_of_2(half)
    q_heads_pad = triton.next_power_of_2(q.shape[1])
    tokens = rows_per_program(num_tokens, q_heads_pad * half_pad, gpu_budget=1024)
    _rotary_kernel[(triton.cdiv(num_tokens, tokens),)](
        positions,
        q,
        k,
        cos_sin_cache,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        HALF_PAD=half_pad,
        Q_HEADS_PAD=q_heads_pad,
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        TOKENS=tokens,
        num_warps=min(8, max(1, tokens * q_heads_pad * half_pad // 512)),
    )
