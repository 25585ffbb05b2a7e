"""Triton multi-LoRA shrink and expand (Punica's BGMV): every token gathers its own adapter.

The batch mixes tokens of several adapters and of the base model; each token carries the
slot of its adapter in the stacked weights (-1 = base, no delta). Shrink computes the
low-rank activations h = x @ A[slot].T, expand adds h @ B[slot].T into a column range of
the projection's output, so q/k/v (or gate/up) deltas land in their part of a fused output.
One program per (token block, output block); tokens of the base model load nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_mode import interpreter_active


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    num_tokens,
    in_dim,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program = one token, BLOCK_R ranks; the dot is taken in float32."""
    t = tl.program_id(0).to(tl.int64)
    rs = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # A base token (slot -1) reads no adapter rows: its rank is 0, so its h is all zeros.
    live_rank = tl.where(slot >= 0, rank, 0)
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < in_dim
        x = tl.load(x_ptr + t * stride_xt + ks, mask=kmask, other=0.0).to(tl.float32)
        amask = (rs < live_rank)[:, None] & kmask[None, :]
        a = tl.load(
            a_ptr + slot * stride_as + rs[:, None] * stride_ar + ks[None, :], mask=amask, other=0.0
        ).to(tl.float32)
        acc += tl.sum(a * x[None, :], 1)
    tl.store(out_ptr + t * stride_ot + rs, acc.to(out_ptr.dtype.element_ty), mask=rs < rank)


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    num_tokens,
    out_dim,
    rank,
    offset,
    stride_ht,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program = one token, BLOCK_N output columns; y += h @ B[slot].T in float32."""
    t = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # A base token (slot -1) has no output columns: it loads and stores nothing.
    live_out = tl.where(slot >= 0, out_dim, 0)
    slot = tl.maximum(slot, 0)
    rs = tl.arange(0, BLOCK_R)
    rmask = rs < rank
    h = tl.load(h_ptr + t * stride_ht + rs * stride_hr, mask=rmask, other=0.0).to(tl.float32)
    nmask = ns < live_out
    bmask = nmask[:, None] & rmask[None, :]
    b = tl.load(b_ptr + slot * stride_bs + ns[:, None] * stride_bn + rs[None, :], mask=bmask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * h[None, :], 1)
    ptrs = y_ptr + t * stride_yt + offset + ns
    y = tl.load(ptrs, mask=nmask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=nmask)


def _contiguous_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink(x: Tensor, a_stack: Tensor, token_slots: Tensor, groups=None) -> Tensor:
    """x [T, in] -> h [T, R] = x @ A[slot].T per token (zeros for slot -1). `groups` is the
    reference's hint and unused here."""
    x, a_stack = _contiguous_rows(x), _contiguous_rows(a_stack)
    num_tokens, in_dim = x.shape
    rank = a_stack.shape[1]
    out = torch.empty(num_tokens, rank, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block_r = min(triton.next_power_of_2(rank), 64)
    block_k = 256 if interpreter_active() else 64
    grid = (num_tokens, triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x,
        a_stack,
        token_slots,
        out,
        num_tokens,
        in_dim,
        rank,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_K=block_k,
    )
    return out


def lora_expand(
    h: Tensor, b_stack: Tensor, token_slots: Tensor, y: Tensor, offset: int = 0, groups=None
) -> None:
    """In place: y[:, offset:offset+out] += h @ B[slot].T per token (nothing for slot -1)."""
    b_stack = _contiguous_rows(b_stack)
    if y.stride(-1) != 1:
        raise ValueError("lora_expand writes into a row-contiguous output")
    num_tokens = h.shape[0]
    out_dim, rank = b_stack.shape[1], b_stack.shape[2]
    if num_tokens == 0:
        return
    block_n = 256 if interpreter_active() else 64
    grid = (num_tokens, triton.cdiv(out_dim, block_n))
    _expand_kernel[grid](
        h,
        b_stack,
        token_slots,
        y,
        num_tokens,
        out_dim,
        rank,
        offset,
        h.stride(0),
        h.stride(1),
        b_stack.stride(0),
        b_stack.stride(1),
        y.stride(0),
        BLOCK_N=block_n,
        BLOCK_R=triton.next_power_of_2(rank),
    )
