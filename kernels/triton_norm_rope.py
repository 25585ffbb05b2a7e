"""Triton fused RMSNorm (+ residual add) and in-place rotary embedding.

Both are memory-bound and launched once per layer, so each is one pass over its rows:
RMSNorm reads x (and the residual) once and writes the normalized row (and the new
residual); rotary rotates every head of one token's q and k in a single program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program = one row; the sum of squares is taken in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
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
):
    """One program = one token: rotate-half over the first 2 * HALF dims of every q and k head."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    h = tl.arange(0, HALF_PAD)
    h_mask = h < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + h, mask=h_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + h, mask=h_mask, other=0.0).to(tl.float32)

    heads = tl.arange(0, Q_HEADS_PAD)
    mask = (heads < num_q_heads)[:, None] & h_mask[None, :]
    first = q_ptr + token * stride_qt + heads[:, None] * stride_qh + h[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    heads = tl.arange(0, KV_HEADS_PAD)
    mask = (heads < num_kv_heads)[:, None] & h_mask[None, :]
    first = k_ptr + token * stride_kt + heads[:, None] * stride_kh + h[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.reference.rms_norm`; any leading dims, contiguous last dim."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    out = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    rows = x2d.shape[0]
    if residual is not None:
        r2d = residual.reshape(-1, hidden)
        new_residual = torch.empty(x2d.shape, dtype=x.dtype, device=x.device)
    else:
        r2d = new_residual = x2d  # unused
    if rows:
        if x2d.stride(-1) != 1 or r2d.stride(-1) != 1 or weight.stride(-1) != 1:
            raise ValueError("rms_norm needs a contiguous last dimension")
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2d,
            r2d,
            weight,
            out,
            new_residual,
            float(eps),
            hidden,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            new_residual.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, new_residual.view(x.shape)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Same contract as `kernels.reference.rotary_embedding`: q [T, Hq, D], k [T, Hkv, D] in place."""
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension on q, k and the cache")
    half = cos_sin_cache.shape[1] // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        num_warps=1 if q.shape[1] * half <= 1024 else 4,
    )
