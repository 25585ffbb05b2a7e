"""Triton paged attention: decode (split-K over the context) and prefill / chunked prefill.

Both read K/V straight from the paged cache [num_blocks, block_size, Hkv, D] through the
block tables, one token row at a time, so a tile may span any number of cache blocks.
Grouped-query attention is handled by giving one program all G query heads that share a KV
head: each K/V element is loaded once per program, not G times.
Softmax runs online in base 2 (scores pre-multiplied by scale * log2(e)), accumulating in float32.
The decode and prefill kernels share one tile loop (`_attend`) and the launch checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.split_k import choose_partition
from kernels.triton_cache import cache_strides
from kernels.triton_mode import interpreter_active

LOG2E = 1.4426950408889634


@triton.jit
def _attend(
    q,
    k_base,
    v_base,
    table_row,
    kv_start,
    kv_end,
    position,
    scale_log2,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Rows of q (ROWS of them) over cache tokens [kv_start, kv_end) of one sequence and KV head,
    whose rows start at `k_base`/`v_base`: (out, m, l), the normalized output and the row max and
    sum of the base-2 softmax. CAUSAL masks token n out of row r past `position[r]`."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    for tile in range(kv_start, kv_end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + (block * stride_kb + offset * stride_kt)[:, None] + d[None, :], mask=kv_mask, other=0.0
        )
        if FP32_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (n[None, :] <= position[:, None]), s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + (block * stride_vb + offset * stride_vt)[:, None] + d[None, :], mask=kv_mask, other=0.0
        )
        p = p.to(v_base.dtype.element_ty)
        if FP32_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc / l_i[:, None], m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scale_log2,
    partition_size,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program = (sequence, KV head, context partition); all G query heads of that KV head."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition_size
    if start < context_len:
        end = tl.minimum(start + partition_size, context_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        head = kv_head * GROUP + g
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            q = q.to(tl.float32)
        acc, m_i, l_i = _attend(
            q,
            k_cache_ptr + kv_head * stride_kh,
            v_cache_ptr + kv_head * stride_vh,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            start,
            end,
            g,
            scale_log2,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            GROUP_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            FP32_DOT,
            DOT_PRECISION,
        )
        if SINGLE_SPLIT:
            tl.store(
                out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None] & d_mask[None, :],
            )
        else:
            # Partials are [B, Hq, num_splits] (m, l) and [B, Hq, num_splits, HEAD_DIM_PAD] (acc / l).
            row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * num_splits + split
            tl.store(part_m_ptr + row, m_i, mask=g_mask)
            tl.store(part_l_ptr + row, l_i, mask=g_mask)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    partition_size,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program = (sequence, query head): merge the partitions' softmax states."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    used = tl.cdiv(context_len, partition_size)
    d = tl.arange(0, HEAD_DIM_PAD)
    zero = tl.zeros([1], tl.int32)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for split in range(0, used):
        m_s = tl.load(part_m_ptr + base + split + zero)
        l_s = tl.load(part_l_ptr + base + split + zero)
        acc_s = tl.load(part_acc_ptr + (base + split) * HEAD_DIM_PAD + d)
        m_new = tl.maximum(m_run, m_s)
        keep = tl.exp2(m_run - m_new)
        weight = l_s * tl.exp2(m_s - m_new)
        acc = acc * keep + acc_s * weight
        l_run = l_run * keep + weight
        m_run = m_new
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d,
        (acc / l_run).to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQS_PAD: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program = (tile of BLOCK_Q query tokens of one sequence, KV head).

    Sequence i owns the programs query_start_loc[i] // BLOCK_Q + i onwards (enough for its
    chunk, spare ones exit), so the grid needs no host-side sync: T // BLOCK_Q + S programs.
    Rows of the tile are (query token, query head of the group) pairs.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seqs = tl.arange(0, SEQS_PAD)
    starts = tl.load(query_start_loc_ptr + seqs, mask=seqs < num_seqs, other=0)
    first_tile = tl.where(seqs < num_seqs, starts // BLOCK_Q + seqs, pid + 1)
    seq = tl.sum((first_tile <= pid).to(tl.int32), 0) - 1
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_off = (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_off < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - q_len
        r = tl.arange(0, BLOCK_Q * GROUP_PAD)
        qi = q_off + r // GROUP_PAD
        g = r % GROUP_PAD
        d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = d < HEAD_DIM
        row_mask = (qi < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        token = (q_begin + qi).to(tl.int64)
        q = tl.load(
            q_ptr + (token * stride_qt + head * stride_qh)[:, None] + d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if FP32_DOT:
            q = q.to(tl.float32)
        acc, _, _ = _attend(
            q,
            k_cache_ptr + kv_head * stride_kh,
            v_cache_ptr + kv_head * stride_vh,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            0,
            tl.minimum(context_len, prefix_len + q_off + BLOCK_Q),
            prefix_len + qi,
            scale_log2,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            BLOCK_Q * GROUP_PAD,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            FP32_DOT,
            DOT_PRECISION,
        )
        tl.store(
            out_ptr + (token * stride_ot + head * stride_oh)[:, None] + d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    """Dot operands in float32 ("ieee", not TF32's ~1e-3 error) for float32 caches, and always in
    Triton's interpreter, whose tl.dot multiplies bfloat16 bit patterns as integers. Upcasting
    bf16 is exact there: products of bf16 values fit float32, as in the GPU's bf16 MMA."""
    fp32 = dtype == torch.float32 or interpreter_active()
    return {"FP32_DOT": fp32, "DOT_PRECISION": "ieee" if fp32 else "tf32"}


def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    partition_size: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. The split count comes from the table width, so trim
    `block_tables` to the batch's longest sequence for best parallelism."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    _check_cache(q, k_cache, v_cache)
    head_dim_pad = _pow2(head_dim, 16)
    if block_n is None:  # the interpreter pays per operation, not per element: big tiles
        if interpreter_active():
            block_n = 256
        else:  # float32 operands take twice the registers (see kernels/compile_check.py)
            block_n = 32 if q.dtype == torch.float32 else 64 if head_dim_pad <= 128 else 32
    max_len = max(1, block_tables.shape[1] * block_size)
    if partition_size is None:
        partition_size = choose_partition(max_len, batch * num_kv_heads, block_n, q.device)
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} must be a multiple of block_n {block_n}")
    num_splits = -(-max_len // partition_size)
    single = num_splits == 1
    if single:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (batch, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device
        )
    scale_log2 = float(scale) * LOG2E
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_acc,
        scale_log2,
        partition_size,
        num_splits,
        *_strides(q, k_cache, v_cache, block_tables, out),
        GROUP=group,
        GROUP_PAD=_pow2(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SINGLE_SPLIT=single,
        **_dot_options(q.dtype),
        num_warps=num_warps or (8 if q.dtype == torch.float32 else 4),
        num_stages=num_stages,
    )
    if not single:
        _decode_reduce_kernel[(batch, num_heads)](
            context_lens,
            out,
            part_m,
            part_l,
            part_acc,
            partition_size,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            num_warps=1 if head_dim_pad <= 64 else 2,
        )
    return out


def paged_attention_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:
    """q [T, Hq, D] of S variable-length chunks -> [T, Hq, D]; causal over prefix + chunk."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _check_cache(q, k_cache, v_cache)
    head_dim_pad = _pow2(head_dim, 16)
    group_pad = _pow2(group)
    if block_m is None:
        block_m = 32 if q.dtype == torch.float32 and not interpreter_active() else 64
    block_q = max(1, block_m // group_pad)
    if block_q * group_pad < 16:  # tl.dot needs at least 16 rows
        block_q = 16 // group_pad
    if block_n is None:
        block_n = 64 if interpreter_active() or (head_dim_pad <= 64 and q.dtype != torch.float32) else 32
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        float(scale) * LOG2E,
        num_seqs,
        *_strides(q, k_cache, v_cache, block_tables, out),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SEQS_PAD=_pow2(num_seqs, 16),
        **_dot_options(q.dtype),
        num_warps=num_warps or (8 if q.dtype == torch.float32 else 4),
        num_stages=num_stages,
    )
    return out


def _strides(q, k_cache, v_cache, block_tables, out) -> tuple[int, ...]:
    """Every stride the decode and prefill kernels take, in their argument order."""
    return (*q.stride()[:2], *cache_strides(k_cache, v_cache), block_tables.stride(0), *out.stride()[:2])


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last (head_dim) dimension")
    if k_cache.shape != v_cache.shape or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"cache {tuple(k_cache.shape)}/{k_cache.dtype} and {tuple(v_cache.shape)}/{v_cache.dtype}"
            f" must match each other and q's dtype {q.dtype}"
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")


__all__ = ["paged_attention_decode", "paged_attention_prefill"]
