"""Shared builders for kernel tests: poisoned paged caches, block tables and a naive attention."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Make torch.empty / empty_like return NaN-filled float tensors, so unwritten outputs fail."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(*args, **kwargs):
        return poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison(real_empty_like(*args, **kwargs))

    mp = pytest.MonkeyPatch()
    mp.setattr(torch, "empty", empty)
    mp.setattr(torch, "empty_like", empty_like)
    try:
        yield
    finally:
        mp.undo()


@dataclass
class PagedKV:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; NaN everywhere no sequence owns
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with an all-NaN block
    context_lens: torch.Tensor  # [B] int32

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


def make_paged_kv(
    gen: torch.Generator,
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    spare_blocks: int = 3,
) -> PagedKV:
    """Random K/V for each sequence's positions in shuffled blocks; every other slot is NaN."""
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = order.pop()  # never written: table padding points here
    tables = torch.full((len(context_lens), max(per_seq)), poison_block, dtype=torch.int32)
    for seq, (length, count) in enumerate(zip(context_lens, per_seq, strict=True)):
        blocks = [order.pop() for _ in range(count)]
        tables[seq, :count] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(length):
            block, offset = blocks[pos // block_size], pos % block_size
            k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedKV(k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32))


def contiguous_kv(kv: PagedKV, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `seq`'s K and V [L, Hkv, D] read slot by slot (the slowest, most obvious way)."""
    length = int(kv.context_lens[seq])
    rows_k, rows_v = [], []
    for pos in range(length):
        block = int(kv.block_tables[seq, pos // kv.block_size])
        rows_k.append(kv.k_cache[block, pos % kv.block_size])
        rows_v.append(kv.v_cache[block, pos % kv.block_size])
    return torch.stack(rows_k), torch.stack(rows_v)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention in float64: q [n, Hq, D] at q_positions over k, v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.arange(k.shape[0])[None, :] > q_positions[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|; NaN anywhere in actual gives inf."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def boundary_lengths(gen: torch.Generator, block_size: int, count: int, max_blocks: int = 4) -> list[int]:
    """Random lengths sitting on or next to block boundaries, plus length 1."""
    lengths = [1]
    while len(lengths) < count:
        blocks = int(torch.randint(1, max_blocks + 1, (1,), generator=gen))
        delta = int(torch.randint(-1, 2, (1,), generator=gen))
        lengths.append(max(1, blocks * block_size + delta))
    return lengths


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
