"""Triton kernels run in Triton's CPU interpreter against naive attention and the references.

Every output buffer the kernels allocate (results and split-K partials) starts as NaN, and
cache slots that no sequence owns are NaN, so an unwritten element or a read past a
sequence's context fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference as ref
from kernels import triton_attention, triton_cache, triton_norm_rope
from kernels.triton_mode import interpreter_active
from tests.kernels.helpers import (
    TOLERANCE,
    boundary_lengths,
    contiguous_kv,
    make_paged_kv,
    naive_attention,
    poisoned_allocations,
    rel_err,
)

BF16 = torch.bfloat16
F32 = torch.float32

# (block_size, head_dim, GQA group, KV heads, dtype): every block size, head dim, group and dtype appears.
CASES = [
    (16, 64, 1, 2, F32),
    (32, 128, 1, 1, BF16),
    (16, 128, 3, 1, F32),
    (32, 64, 3, 2, BF16),
    (32, 64, 8, 1, F32),
    (16, 128, 8, 1, BF16),
]
CASE_IDS = [f"bs{c[0]}-d{c[1]}-g{c[2]}-kv{c[3]}-{str(c[4]).removeprefix('torch.')}" for c in CASES]


ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = interpreter_active()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton was imported in compiled mode: covered by test_in_fresh_interpreter_process",
)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter is active in this process")
def test_in_fresh_interpreter_process() -> None:
    """Something imported triton before TRITON_INTERPRET=1 could be set: run the interpreter tests anew."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "not fresh",
        __file__,
        str(ROOT / "tests/kernels/test_ops.py"),
        str(ROOT / "tests/kernels/test_lora_kernels.py"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[
        -2000:
    ]


@needs_interpreter
@pytest.mark.parametrize(("block_size", "head_dim", "group", "num_kv_heads", "dtype"), CASES, ids=CASE_IDS)
def test_decode(block_size: int, head_dim: int, group: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size + head_dim + group)
    lengths = boundary_lengths(gen, block_size, count=4, max_blocks=3)
    kv = make_paged_kv(gen, lengths, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = torch.stack(
        [
            naive_attention(q[s : s + 1], *contiguous_kv(kv, s), torch.tensor([n - 1]), scale)[0]
            for s, n in enumerate(lengths)
        ]
    )
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    with poisoned_allocations():
        single = triton_attention.paged_attention_decode(*args)
        # Partitions of 16 tokens: many splits per sequence, merged by the reduce kernel.
        split = triton_attention.paged_attention_decode(*args, partition_size=16, block_n=16)
        reference = ref.paged_attention_decode(*args)
    assert single.dtype == dtype
    assert rel_err(single, expected) < TOLERANCE[dtype]
    assert rel_err(split, expected) < TOLERANCE[dtype]
    assert rel_err(reference, expected) < TOLERANCE[dtype]


@needs_interpreter
@pytest.mark.parametrize(("block_size", "head_dim", "group", "num_kv_heads", "dtype"), CASES, ids=CASE_IDS)
def test_prefill_and_chunked_prefill(
    block_size: int, head_dim: int, group: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(block_size * head_dim * group)
    # (cached prefix, chunk): plain prefill across blocks, chunk over a prefix ending mid-block,
    # a one-token chunk (decode inside a prefill batch), a chunk starting on a block boundary.
    shapes = [(0, block_size + 3), (block_size + 5, block_size - 3), (2 * block_size - 1, 1), (block_size, 9)]
    kv = make_paged_kv(gen, [p + n for p, n in shapes], block_size, num_kv_heads, head_dim, dtype)
    q_lens = [n for _, n in shapes]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = torch.cat(
        [
            naive_attention(
                q[int(query_start_loc[s]) : int(query_start_loc[s + 1])],
                *contiguous_kv(kv, s),
                torch.arange(prefix, prefix + n),
                scale,
            )
            for s, (prefix, n) in enumerate(shapes)
        ]
    )
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.context_lens, scale)
    with poisoned_allocations():
        # Small tiles: several query tiles per sequence and KV tiles per context, as on a GPU.
        out = triton_attention.paged_attention_prefill(*args, block_m=16, block_n=16)
        big_tiles = triton_attention.paged_attention_prefill(*args)
        reference = ref.paged_attention_prefill(*args)
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(big_tiles, expected) < TOLERANCE[dtype]
    assert rel_err(reference, expected) < TOLERANCE[dtype]


@needs_interpreter
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_write_kv_cache_from_strided_views(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim, block_size = 7, 3, 64, 16
    qkv = torch.randn(num_tokens, (6 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    _, key, value = qkv.split([6 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([0, 15, 16, -1, 40, 63, -5])
    shape = (4, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    triton_cache.write_kv_cache(key, value, caches[0], caches[1], slots)
    ref.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert int(caches[0].isfinite().all(-1).all(-1).sum()) == 5  # five slots written, two skipped


@needs_interpreter
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hidden", [576, 128])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(6, hidden, generator=gen).to(dtype)
    residual = torch.randn(6, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    with poisoned_allocations():
        out, new_residual = triton_norm_rope.rms_norm(x, weight, 1e-5, residual)
        plain = triton_norm_rope.rms_norm(x, weight, 1e-5)
    expected, expected_residual = ref.rms_norm(x, weight, 1e-5, residual)
    if dtype == F32:
        assert torch.equal(new_residual, expected_residual)
    else:  # the interpreter truncates float32 -> bfloat16 where GPUs round to nearest: 1 ulp
        assert rel_err(new_residual, expected_residual) < TOLERANCE[dtype]
    assert rel_err(out, expected) < TOLERANCE[dtype]
    assert rel_err(plain, ref.rms_norm(x, weight, 1e-5)) < TOLERANCE[dtype]


@needs_interpreter
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "dtype"), [(64, 64, F32), (128, 128, BF16), (64, 32, F32)]
)
def test_rotary_in_place_on_qkv_views(head_dim: int, rotary_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_tokens, num_heads, num_kv_heads = 5, 9, 3
    cache = ref.build_cos_sin_cache(head_dim, 200, 10000.0, None, dtype=torch.float32, rotary_dim=rotary_dim)
    positions = torch.tensor([0, 1, 15, 16, 199])
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(dtype)
    expected = qkv.clone()
    for buf, rotate in ((qkv, triton_norm_rope.rotary_embedding), (expected, ref.rotary_embedding)):
        q, k, _ = buf.split(sizes, dim=-1)
        rotate(
            positions,
            q.view(num_tokens, num_heads, head_dim),
            k.view(num_tokens, num_kv_heads, head_dim),
            cache,
        )
    assert rel_err(qkv, expected) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, -sizes[2] :], expected[:, -sizes[2] :])  # v untouched
