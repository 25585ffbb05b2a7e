"""Multi-LoRA shrink/expand: the Triton kernels (interpreter) and the torch reference against a
per-token loop, on a batch that mixes base tokens (slot -1) and several adapters.

Outputs start as NaN (poisoned allocations), so a row the shrink forgets to write fails; the
expand must leave base rows and columns outside its range untouched.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference as ref
from kernels import triton_lora
from kernels.triton_mode import interpreter_active
from tests.kernels.helpers import TOLERANCE, poisoned_allocations, rel_err

needs_interpreter = pytest.mark.skipif(
    not interpreter_active(),
    reason="triton was imported in compiled mode: covered by test_in_fresh_interpreter_process",
)


def _naive_shrink(x, a, slots):
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = a[s].double() @ x[t].double()
    return out


def _naive_expand(h, b, slots, y, offset):
    y = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            y[t, offset : offset + b.shape[1]] += b[s].double() @ h[t].double()
    return y


def _case(dtype, num_tokens=13, in_dim=96, rank=24, out_dim=80, slots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_dim, generator=g).to(dtype)
    a = torch.randn(slots, rank, in_dim, generator=g).to(dtype) / in_dim**0.5
    b = torch.randn(slots, out_dim, rank, generator=g).to(dtype)
    token_slots = torch.randint(-1, slots, (num_tokens,), generator=g)
    token_slots[0], token_slots[1] = -1, slots - 1  # the base and the last slot always appear
    return x, a, b, token_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_a_per_token_loop(dtype):
    x, a, b, slots = _case(dtype)
    h = ref.lora_shrink(x, a, slots)
    assert rel_err(h, _naive_shrink(x, a, slots).to(dtype)) < TOLERANCE[dtype]
    y = torch.randn(x.shape[0], 200).to(dtype)
    want = _naive_expand(h, b, slots, y, 37)
    ref.lora_expand(h, b, slots, y, 37)
    assert rel_err(y, want.to(dtype)) < TOLERANCE[dtype]


def test_reference_single_adapter_and_base_only_batches():
    x, a, _b, _ = _case(torch.float32)
    one = torch.full((x.shape[0],), 2)
    assert rel_err(ref.lora_shrink(x, a, one), _naive_shrink(x, a, one).float()) < 1e-5
    base = torch.full((x.shape[0],), -1)
    assert ref.lora_groups(base) == []
    assert torch.equal(ref.lora_shrink(x, a, base), torch.zeros(x.shape[0], a.shape[1]))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "out_dim"), [(8, 80), (24, 300)])
def test_triton_shrink_expand_match_reference(dtype, rank, out_dim):
    x, a, b, slots = _case(dtype, rank=rank, out_dim=out_dim)
    with poisoned_allocations():
        h = triton_lora.lora_shrink(x, a, slots)
    assert rel_err(h, ref.lora_shrink(x, a, slots)) < TOLERANCE[dtype]
    # The expand reads a column slice of h (the fused q/k/v case) and writes an offset range.
    half = rank // 2
    b_half = b[:, :, :half].contiguous()
    y = torch.randn(x.shape[0], out_dim + 50).to(dtype)
    want = y.clone()
    ref.lora_expand(h[:, half:], b_half, slots, want, 50)
    triton_lora.lora_expand(h[:, half:], b_half, slots, y, 50)
    assert rel_err(y, want) < TOLERANCE[dtype]
    base_rows = slots < 0
    assert torch.equal(y[base_rows], want[base_rows])
