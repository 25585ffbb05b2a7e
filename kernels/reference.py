"""PyTorch reference kernels: the CPU hot path and the ground truth the Triton kernels are tested against.

Shapes follow the kernel contract in docs/engine.md. Every function here is vectorized over
the batch (decode runs one batched attention per layer), works on any device, and never
reads cache slots past a sequence's context length into the result: gathered tails of
partially filled blocks are zeroed before attention, so stale or NaN garbage there is harmless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.workspace import scratch


def write_kv_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Scatter `key`/`value` [T, Hkv, D] into the paged caches at `slot_mapping` [T] (negative = skip)."""
    write_kv_planned(key, value, k_cache, v_cache, plan_kv_write(slot_mapping))


@dataclass(frozen=True)
class KVWrite:
    """Where one step's new K/V rows go, worked out once per step for every layer."""

    slots: Tensor  # [n] int64, all >= 0
    rows: Tensor | None  # [n] int64 rows of key/value to keep; None = every row


def plan_kv_write(slot_mapping: Tensor) -> KVWrite:
    """Drop the skipped (negative) slots once, instead of testing them in every layer."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if bool(keep.all()):
        return KVWrite(slots, None)
    rows = keep.nonzero().squeeze(1)
    return KVWrite(slots.index_select(0, rows), rows)


def write_kv_planned(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, plan: KVWrite) -> None:
    """`write_kv_cache` with this step's `plan_kv_write`: two index copies per layer."""
    if plan.slots.numel() == 0:
        return
    if plan.rows is not None:
        key, value = key.index_select(0, plan.rows), value.index_select(0, plan.rows)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, value)


def _gather_blocks(cache: Tensor, block_ids: Tensor, name: str) -> Tensor:
    """Copy the blocks `block_ids` [B, nb] into a reused scratch buffer -> [B, nb*block_size, Hkv, D].

    Reusing the buffer matters on CPU: a fresh multi-megabyte allocation per layer costs
    more in page faults than the copy itself.
    """
    batch, num_blocks = block_ids.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    out = scratch(name, (batch * num_blocks, block_size, num_kv_heads, head_dim), cache.dtype, cache.device)
    torch.index_select(cache, 0, block_ids.reshape(-1).long().clamp_min(0), out=out)
    return out.view(batch, num_blocks * block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class DecodeLayout:
    """What every layer's decode attention reads in one step, worked out once per step.

    The rows' KV blocks are gathered into one padded [B, num_blocks * block_size] span per
    layer. When every row has the same context length the span is cut to it and needs no
    mask; otherwise the positions past each row's length are zeroed (stale cache slots may
    hold NaN) and masked.
    """

    block_ids: Tensor  # [B * num_blocks] int64, >= 0
    batch: int
    num_blocks: int
    length: int  # positions per row after the cut (the span when masked)
    invalid: Tensor | None  # flat positions past a row's context, [n] int64
    mask: Tensor | None  # [B, 1, 1, length] bool, True = attend
    # One row whose blocks are consecutive in the cache: its span is a view, no gather.
    first_block: int | None = None


def plan_decode(block_tables: Tensor, context_lens: Tensor, block_size: int) -> DecodeLayout:
    """The layout of one decode group (block_tables [B, max_blocks], context_lens [B])."""
    lens = context_lens.tolist()
    batch, longest = len(lens), max(lens, default=0)
    num_blocks = -(-longest // block_size)
    block_ids = block_tables[:, :num_blocks].reshape(-1).long().clamp_min(0)
    if min(lens, default=0) == longest:
        first = None
        if batch == 1 and num_blocks:
            ids = block_ids.tolist()
            if ids == list(range(ids[0], ids[0] + num_blocks)):
                first = ids[0]
        return DecodeLayout(block_ids, batch, num_blocks, longest, None, None, first)
    span = num_blocks * block_size
    valid = (
        torch.arange(span, device=block_tables.device)[None, :]
        < context_lens.to(block_tables.device)[:, None]
    )
    invalid = (~valid).reshape(-1).nonzero().squeeze(1)
    return DecodeLayout(block_ids, batch, num_blocks, span, invalid, valid[:, None, None, :])


def _gather_span(cache: Tensor, layout: DecodeLayout, name: str) -> Tensor:
    """A layout's blocks of `cache` -> [B, length, Hkv, D] (past-context tails zeroed)."""
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    if layout.first_block is not None:
        first, span_len = layout.first_block, layout.num_blocks * block_size
        return cache[first : first + layout.num_blocks].view(1, span_len, num_kv_heads, head_dim)[
            :, : layout.length
        ]
    out = scratch(
        name, (layout.block_ids.numel(), block_size, num_kv_heads, head_dim), cache.dtype, cache.device
    )
    torch.index_select(cache, 0, layout.block_ids, out=out)
    span = out.view(layout.batch, layout.num_blocks * block_size, num_kv_heads, head_dim)
    if layout.invalid is not None and layout.invalid.numel():
        span.view(-1, num_kv_heads * head_dim).index_fill_(0, layout.invalid, 0)
    return span[:, : layout.length]


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: DecodeLayout, scale: float
) -> Tensor:
    """One query token per row over the KV a `plan_decode` layout names: q [B, Hq, D] -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    num_kv_heads = k_cache.shape[2]
    keys = _gather_span(k_cache, layout, "decode_k")
    values = _gather_span(v_cache, layout, "decode_v")
    # GQA without copies: the G query heads of one KV head become G "query positions".
    out = F.scaled_dot_product_attention(
        q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=layout.mask,
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """One query token per sequence over its paged KV: q [B, Hq, D] -> [B, Hq, D]."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    layout = plan_decode(block_tables, context_lens, k_cache.shape[1])
    return decode_attention(q, k_cache, v_cache, layout, scale)


def paged_attention_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """Variable-length query chunks attending causally to their cached prefix and themselves.

    q [T, Hq, D] holds S sequences back to back (`query_start_loc` [S+1]); chunk i covers
    positions context_lens[i]-q_len_i .. context_lens[i]-1. One SDPA per sequence: prefill
    batches hold few sequences, and each call is large.
    """
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lengths = context_lens.tolist()
    for seq, context_len in enumerate(lengths):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len == 0:
            continue
        num_blocks = -(-context_len // block_size)
        block_ids = block_tables[seq : seq + 1, :num_blocks]
        keys = _gather_blocks(k_cache, block_ids, "prefill_k")[0, :context_len]
        values = _gather_blocks(v_cache, block_ids, "prefill_v")[0, :context_len]
        q_seq = q[begin:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k_seq = keys.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        v_seq = values.transpose(0, 1).unsqueeze(0)
        gqa = num_heads != num_kv_heads
        if q_len == context_len:
            res = F.scaled_dot_product_attention(
                q_seq, k_seq, v_seq, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            offset = context_len - q_len
            rows = torch.arange(q_len, device=q.device)[:, None] + offset
            mask = torch.arange(context_len, device=q.device)[None, :] <= rows
            res = F.scaled_dot_product_attention(
                q_seq, k_seq, v_seq, attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        out[begin:end] = res[0].transpose(0, 1)
    return out


_NORM_ONE_CALL_MAX = 64 * 1024  # elements (64 rows of a 1k hidden size): measured both ways


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm in float32, result in x's dtype; with `residual`, normalizes x + residual and returns it too."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() <= _NORM_ONE_CALL_MAX:
        # Decode-sized rows: torch's rms_norm, one Python dispatch instead of seven and
        # bit-identical on CPU to the formula below (rsqrt(sum(x^2) / n + eps) * x * w). On
        # prefill-sized inputs its composite is slower (512 x 576: 2.3 vs 1.6 ms), so those
        # keep the formula.
        out = torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return out if residual is None else (out, x)
    xf = x.float()
    inv_rms = (xf * xf).sum(-1, keepdim=True).div_(xf.shape[-1]).add_(eps).rsqrt_()
    out = torch.mul(xf, inv_rms).mul_(weight).to(x.dtype)
    return out if residual is None else (out, x)


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    angles: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-half layout, first rot_dim dims).

    `angles`: `rotary_angles(positions, cos_sin_cache)`, when the caller reuses them across
    layers; k may be None when q already holds the key heads (one view over both)."""
    cos, sin = rotary_angles(positions, cos_sin_cache) if angles is None else angles
    rot_dim = cos.shape[-1]
    half = rot_dim // 2
    for x in (q, k):
        if x is None:
            continue
        part = x if rot_dim == x.shape[-1] else x[..., :rot_dim]
        # (x1, x2) * (cos, cos) + (x2, x1) * (-sin, sin) = (x1 cos - x2 sin, x2 cos + x1 sin)
        swapped = torch.roll(part, half, dims=-1)
        if part.dtype == torch.float32:  # in place, four ops (addcmul would round differently)
            part.mul_(cos).add_(swapped.mul_(sin))
        else:
            part.copy_(part.float() * cos + swapped.float() * sin)


def rotary_angles(positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, cos) and (-sin, sin) of `positions`, [T, 1, rot_dim] float32 each: what
    `rotary_embedding` multiplies by; the same for every layer of a step."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.reshape(-1).long()).float()
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


def _scaled_inv_freq(inv_freq: Tensor, scaling: dict[str, Any] | None) -> Tensor:
    """Apply Hugging Face `rope_scaling` to the inverse frequencies."""
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        original_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
        # band between them interpolated linearly in original_len / wavelen.
        slowed = torch.where(wavelen > original_len / low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        medium = (wavelen >= original_len / high_freq_factor) & (wavelen <= original_len / low_freq_factor)
        return torch.where(medium, blended, slowed)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (None, 'linear', 'llama3')")


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    rotary_dim: int | None = None,
) -> Tensor:
    """[max_position, rot_dim] = cat(cos, sin), computed in float32 like Hugging Face, stored as `dtype`."""
    rot_dim = head_dim if rotary_dim is None else rotary_dim
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and at most head_dim {head_dim}")
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim
    inv_freq = _scaled_inv_freq(1.0 / (theta**exponents), scaling)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


# -- LoRA (multi-adapter) ------------------------------------------------------------------
# Adapters live in stacked slots: A [S, R, in], B [S, out, R] (scaling folded into B). Every
# token names its slot (-1 = the base model, no delta). `groups` (slot, row indices) may be
# precomputed once per step by the caller; the reference then does one matmul per adapter
# present in the batch, never one per request.


def lora_groups(token_slots: Tensor) -> list[tuple[int, Tensor | None]]:
    """(slot, rows) for each slot in use; rows is None when every token uses that slot."""
    slots = token_slots.tolist()
    distinct = sorted(set(slots))
    if distinct == [-1]:
        return []
    if len(distinct) == 1:
        return [(distinct[0], None)]
    out = []
    for s in distinct:
        if s >= 0:
            rows = torch.tensor([i for i, x in enumerate(slots) if x == s], device=token_slots.device)
            out.append((s, rows))
    return out


def lora_shrink(
    x: Tensor, a_stack: Tensor, token_slots: Tensor, groups: list[tuple[int, Tensor | None]] | None = None
) -> Tensor:
    """x [T, in] -> h [T, R] = x @ A[slot].T per token (zeros for slot -1)."""
    groups = lora_groups(token_slots) if groups is None else groups
    if len(groups) == 1 and groups[0][1] is None:  # one adapter for every token: one matmul
        return x @ a_stack[groups[0][0]].t()
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    for slot, rows in groups:
        assert rows is not None
        out.index_copy_(0, rows, x.index_select(0, rows) @ a_stack[slot].t())
    return out


def lora_expand(
    h: Tensor,
    b_stack: Tensor,
    token_slots: Tensor,
    y: Tensor,
    offset: int = 0,
    groups: list[tuple[int, Tensor | None]] | None = None,
) -> None:
    """In place: y[:, offset:offset+out] += h @ B[slot].T per token (nothing for slot -1)."""
    groups = lora_groups(token_slots) if groups is None else groups
    n = b_stack.shape[1]
    view = y[:, offset : offset + n]
    for slot, rows in groups:
        if rows is None:
            view.addmm_(h, b_stack[slot].t())
        else:
            view.index_add_(0, rows, h.index_select(0, rows) @ b_stack[slot].t())
