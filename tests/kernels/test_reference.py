"""The PyTorch reference kernels against the most naive formulations (and Hugging Face's RoPE)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref
from tests.kernels import helpers


@pytest.mark.parametrize(
    ("block_size", "head_dim", "group", "num_kv_heads"),
    [
        (16, 64, 1, 2),
        (16, 128, 3, 2),
        (32, 64, 8, 1),
        (32, 128, 3, 3),
    ],
)
def test_decode_matches_naive_attention(
    block_size: int, head_dim: int, group: int, num_kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(block_size * head_dim + group)
    lengths = helpers.boundary_lengths(gen, block_size, count=6)
    kv = helpers.make_paged_kv(gen, lengths, block_size, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen)
    scale = head_dim**-0.5
    with helpers.poisoned_allocations():
        out = ref.paged_attention_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    for seq, length in enumerate(lengths):
        k, v = helpers.contiguous_kv(kv, seq)
        expected = helpers.naive_attention(q[seq : seq + 1], k, v, torch.tensor([length - 1]), scale)[0]
        assert helpers.rel_err(out[seq], expected) < 1e-5, (seq, length)


@pytest.mark.parametrize("lengths", [[37, 37, 37], [16, 16], [5], [40, 3, 17, 32]])
def test_one_decode_plan_serves_every_layer(lengths: list[int]) -> None:
    """The per-step layout (cut to a shared length, or masked) gives each layer naive attention."""
    gen = torch.Generator().manual_seed(sum(lengths))
    block_size, num_kv_heads, group, head_dim = 16, 2, 3, 32
    kv = helpers.make_paged_kv(gen, lengths, block_size, num_kv_heads, head_dim, torch.float32)
    plan = ref.plan_decode(kv.block_tables, kv.context_lens, block_size)
    assert (plan.mask is None) == (len(set(lengths)) == 1)
    for layer in range(2):
        if layer:  # the next layer: same blocks, new contents (unowned slots stay NaN)
            kv.k_cache = kv.k_cache + torch.randn(kv.k_cache.shape, generator=gen)
            kv.v_cache = kv.v_cache + torch.randn(kv.v_cache.shape, generator=gen)
        q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen)
        with helpers.poisoned_allocations():
            out = ref.decode_attention(q, kv.k_cache, kv.v_cache, plan, 0.2)
        for seq, length in enumerate(lengths):
            k, v = helpers.contiguous_kv(kv, seq)
            expected = helpers.naive_attention(q[seq : seq + 1], k, v, torch.tensor([length - 1]), 0.2)[0]
            assert helpers.rel_err(out[seq], expected) < 1e-5, (layer, seq, length)


@pytest.mark.parametrize(("block_size", "group"), [(16, 3), (32, 1), (16, 8)])
def test_prefill_matches_naive_attention_over_cached_prefix(block_size: int, group: int) -> None:
    """Full prefills, chunks over a cached prefix and single-token chunks in one batch."""
    gen = torch.Generator().manual_seed(block_size + group)
    num_kv_heads, head_dim = 2, 64
    # (cached prefix, chunk length): no prefix; prefix ending mid-block; q_len 1; chunk across blocks.
    shapes = [
        (0, 2 * block_size + 3),
        (block_size + 5, block_size - 2),
        (3 * block_size, 1),
        (7, 2 * block_size),
    ]
    kv = helpers.make_paged_kv(
        gen, [p + n for p, n in shapes], block_size, num_kv_heads, head_dim, torch.float32
    )
    q_lens = [n for _, n in shapes]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    scale = 0.125
    with helpers.poisoned_allocations():
        out = ref.paged_attention_prefill(
            q, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.context_lens, scale
        )
    for seq, (prefix, q_len) in enumerate(shapes):
        begin = int(query_start_loc[seq])
        k, v = helpers.contiguous_kv(kv, seq)
        positions = torch.arange(prefix, prefix + q_len)
        expected = helpers.naive_attention(q[begin : begin + q_len], k, v, positions, scale)
        assert helpers.rel_err(out[begin : begin + q_len], expected) < 1e-5, seq


def test_chunked_prefill_then_decode_equals_one_full_prefill() -> None:
    """Writing KV and attending chunk by chunk (then token by token) reproduces the one-shot prefill."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, group, head_dim, length = 16, 2, 3, 64, 45
    q = torch.randn(length, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(length, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(length, num_kv_heads, head_dim, generator=gen)
    blocks = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    slots = torch.stack(
        [blocks[0, p // block_size] * block_size + p % block_size for p in range(length)]
    ).long()

    def fresh_cache() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (8, block_size, num_kv_heads, head_dim)
        return torch.full(shape, float("nan")), torch.full(shape, float("nan"))

    k_cache, v_cache = fresh_cache()
    ref.write_kv_cache(k, v, k_cache, v_cache, slots)
    whole = ref.paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        blocks,
        torch.tensor([0, length], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32),
        0.1,
    )
    k_cache, v_cache = fresh_cache()
    pieces = []
    for begin, end in [(0, 10), (10, 33)]:
        ref.write_kv_cache(k[begin:end], v[begin:end], k_cache, v_cache, slots[begin:end])
        pieces.append(
            ref.paged_attention_prefill(
                q[begin:end],
                k_cache,
                v_cache,
                blocks,
                torch.tensor([0, end - begin], dtype=torch.int32),
                torch.tensor([end], dtype=torch.int32),
                0.1,
            )
        )
    for pos in range(33, length):
        ref.write_kv_cache(k[pos : pos + 1], v[pos : pos + 1], k_cache, v_cache, slots[pos : pos + 1])
        pieces.append(
            ref.paged_attention_decode(
                q[pos : pos + 1], k_cache, v_cache, blocks, torch.tensor([pos + 1], dtype=torch.int32), 0.1
            )
        )
    assert helpers.rel_err(torch.cat(pieces), whole) < 1e-5


def test_write_kv_cache_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    key = torch.randn(3, 2, 8, generator=gen)
    value = torch.randn(3, 2, 8, generator=gen)
    ref.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([17, -1, 63]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[3, 15], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # exactly two slots written


def test_one_row_on_consecutive_blocks_reads_a_view_and_matches_the_gathered_copy() -> None:
    """B=1 on blocks next to each other in the cache: the span is a view (no gather), same result."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, head_dim, length = 16, 2, 32, 37
    kv = helpers.make_paged_kv(gen, [length], block_size, num_kv_heads, head_dim, torch.float32)
    k, v = helpers.contiguous_kv(kv, 0)
    q = torch.randn(1, num_kv_heads * 3, head_dim, generator=gen)
    expected = helpers.naive_attention(q, k, v, torch.tensor([length - 1]), 0.2)
    for first in (0, 2):  # blocks first..first+2 hold the sequence in order
        k_cache, v_cache = (torch.full_like(kv.k_cache, float("nan")) for _ in range(2))
        nb = -(-length // block_size)
        for pos in range(length):
            k_cache[first + pos // block_size, pos % block_size] = k[pos]
            v_cache[first + pos // block_size, pos % block_size] = v[pos]
        tables = torch.arange(first, first + nb, dtype=torch.int32)[None]
        plan = ref.plan_decode(tables, kv.context_lens, block_size)
        assert plan.first_block == first
        out = ref.decode_attention(q, k_cache, v_cache, plan, 0.2)
        assert helpers.rel_err(out, expected) < 1e-5
    gapped = torch.tensor([[0, 2, 3]], dtype=torch.int32)  # not consecutive: gathered
    assert ref.plan_decode(gapped, kv.context_lens, block_size).first_block is None


def test_planned_kv_write_drops_negative_slots_once_and_writes_like_the_plain_one() -> None:
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(4, 2, 8, generator=gen)
    value = torch.randn(4, 2, 8, generator=gen)
    for slots in ([3, 17, 40, 63], [17, -1, 63, -1]):
        mapping = torch.tensor(slots)
        plain = [torch.zeros(4, 16, 2, 8) for _ in range(2)]
        planned = [torch.zeros(4, 16, 2, 8) for _ in range(2)]
        ref.write_kv_cache(key, value, *plain, mapping)
        plan = ref.plan_kv_write(mapping)
        assert (plan.rows is None) == (min(slots) >= 0)
        for _ in range(2):  # one plan serves every layer
            ref.write_kv_planned(key, value, *planned, plan)
        assert all(torch.equal(a, b) for a, b in zip(plain, planned))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    weight = torch.rand(96, generator=gen).to(dtype) + 0.5
    summed = (x.double() + residual.double()).to(dtype)
    out, new_residual = ref.rms_norm(x, weight, 1e-6, residual)
    assert out.dtype == dtype and torch.equal(new_residual, summed)
    s = summed.double()
    expected = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert helpers.rel_err(out, expected) < tol
    assert (
        helpers.rel_err(
            ref.rms_norm(x, weight, 1e-6),
            x.double() / x.double().pow(2).mean(-1, True).add(1e-6).sqrt() * weight.double(),
        )
        < tol
    )


def test_float32_rms_norm_is_bit_identical_to_its_formula() -> None:
    """The float32 path runs torch's own rms_norm; it must round exactly like the formula
    rsqrt(sum(x^2) / n + eps) * x * w, so greedy outputs do not move with the kernel."""
    gen = torch.Generator().manual_seed(4)
    for rows in (1, 8, 33, 200):  # both sides of the one-call threshold
        x = torch.randn(rows, 576, generator=gen) * 3
        weight = torch.randn(576, generator=gen)
        inv_rms = (x * x).sum(-1, keepdim=True).div_(576).add_(1e-5).rsqrt_()
        assert torch.equal(ref.rms_norm(x, weight, 1e-5), torch.mul(x, inv_rms).mul_(weight))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_rotates_pairs_by_position_angle(rotary_dim: int) -> None:
    """Each pair (i, i + rot/2) is the complex number x_i + j x_{i+half} multiplied by e^{j pos θ_i}."""
    gen = torch.Generator().manual_seed(2)
    head_dim, theta = 64, 10000.0
    cache = ref.build_cos_sin_cache(head_dim, 300, theta, None, rotary_dim=rotary_dim)
    positions = torch.tensor([0, 1, 17, 299])
    q = torch.randn(4, 3, head_dim, generator=gen)
    k = torch.randn(4, 1, head_dim, generator=gen)
    q_before, k_before = q.clone(), k.clone()
    ref.rotary_embedding(positions, q, k, cache)
    half = rotary_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = torch.exp(1j * positions.double()[:, None, None] * freqs)
    for before, after in ((q_before, q), (k_before, k)):
        z = torch.complex(before[..., :half].double(), before[..., half:rotary_dim].double()) * angle
        assert torch.allclose(after[..., :half].double(), z.real, atol=1e-4)
        assert torch.allclose(after[..., half:rotary_dim].double(), z.imag, atol=1e-4)
        assert torch.equal(after[..., rotary_dim:], before[..., rotary_dim:])


def test_rotary_from_shared_angles_on_one_qk_view_is_bitwise_the_textbook_formula() -> None:
    """Angles gathered once per step, q and k heads rotated through one view of the qkv rows."""
    gen = torch.Generator().manual_seed(4)
    head_dim, hq, hkv, n, half = 64, 6, 2, 5, 32
    cache = ref.build_cos_sin_cache(head_dim, 128, 10000.0, None)
    positions = torch.tensor([3, 0, 77, 127, 9])
    qkv = torch.randn(n, (hq + 2 * hkv) * head_dim, generator=gen)
    heads = qkv.clone().view(n, hq + 2 * hkv, head_dim)
    cos, sin = cache[positions, None, :half], cache[positions, None, half:]
    x1, x2 = heads[:, : hq + hkv, :half], heads[:, : hq + hkv, half:]
    expected = heads.clone()
    expected[:, : hq + hkv] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    qk = qkv[:, : (hq + hkv) * head_dim].view(n, hq + hkv, head_dim)
    ref.rotary_embedding(positions, qk, None, cache, ref.rotary_angles(positions, cache))
    assert torch.equal(qkv.view(n, -1, head_dim), expected)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_cos_sin_cache_matches_hugging_face(scaling: dict | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = 500000.0
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    config = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=params,
    )
    if params["rope_type"] == "default":
        inv_freq = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        assert attention_scaling == 1.0
    cache = ref.build_cos_sin_cache(64, 4096, theta, scaling)
    freqs = torch.outer(torch.arange(4096).float(), inv_freq.float())
    assert torch.allclose(cache, torch.cat((freqs.cos(), freqs.sin()), -1), atol=1e-6)
    if scaling and scaling["rope_type"] == "llama3":
        plain = ref.build_cos_sin_cache(64, 2, theta, None)
        # Highest frequency kept, lowest slowed by `factor` (sin x ~ x at position 1).
        assert math.isclose(cache[1, 32], plain[1, 32], rel_tol=1e-6)
        assert math.isclose(cache[1, 63], plain[1, 63] / 8, rel_tol=1e-4)


def test_unknown_rope_scaling_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="yarn"):
        ref.build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
