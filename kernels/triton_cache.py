"""Triton KV-cache write: scatter each new token's K and V rows into its slot."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels.triton_norm_rope import rows_per_program


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """One program = TOKENS tokens, all their KV heads; a negative slot means "do not store"."""
    token = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (slot >= 0)[:, None, None] & (heads < num_kv_heads)[None, :, None] & (d < HEAD_DIM)[None, None, :]
    src_k = key_ptr + token[:, None, None] * stride_kt + heads[None, :, None] * stride_kh + d[None, None, :]
    src_v = value_ptr + token[:, None, None] * stride_vt + heads[None, :, None] * stride_vh + d[None, None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    dst_k = (block * stride_kcb + offset * stride_kct)[:, None, None] + heads[None, :, None] * stride_kch
    dst_v = (block * stride_vcb + offset * stride_vct)[:, None, None] + heads[None, :, None] * stride_vch
    tl.store(k_cache_ptr + dst_k + d[None, None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_v + d[None, None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def cache_strides(k_cache: Tensor, v_cache: Tensor) -> tuple[int, ...]:
    """The block, token and head strides of the K cache, then of the V cache: the order every
    paged-cache kernel takes them in."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def write_kv_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Same contract as `kernels.reference.write_kv_cache`; key/value may be strided views."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache needs a contiguous last (head_dim) dimension")
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_dim_pad = triton.next_power_of_2(head_dim)
    tokens = rows_per_program(num_tokens, heads_pad * head_dim_pad, gpu_budget=1024)
    _write_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *cache_strides(k_cache, v_cache),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        HEAD_DIM_PAD=head_dim_pad,
        TOKENS=tokens,
        num_warps=min(8, max(1, tokens * heads_pad * head_dim_pad // 512)),
    )
