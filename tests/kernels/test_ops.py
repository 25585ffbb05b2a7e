"""The dispatch point: backend selection, lazy Triton import, and both backends agreeing on one layer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import ops
from kernels.triton_mode import interpreter_active
from tests.kernels.helpers import make_paged_kv, rel_err

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = ops.get_backend()
    yield
    ops.set_backend(previous)


def test_set_backend_validates_and_context_manager_restores() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        ops.set_backend("cuda")
    ops.set_backend("torch")
    with ops.use_backend("triton"):
        assert ops.get_backend() == "triton"
    assert ops.get_backend() == "torch"


def test_auto_uses_the_reference_on_cpu_and_forced_triton_needs_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ops.set_backend("auto")
    assert ops.resolve_backend("cpu") == "torch"
    ops.set_backend("torch")
    assert ops.resolve_backend("cuda") == "torch"
    ops.set_backend("triton")
    monkeypatch.setattr(ops, "interpreter_active", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="start the process with TRITON_INTERPRET=1"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="set after triton had been imported"):
        ops.resolve_backend("cpu")
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        ops.resolve_backend("cuda")


def test_cpu_process_never_imports_triton_and_works_without_it() -> None:
    """With `import triton` made to fail, every op still runs on CPU under "auto"."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # any attempt to import triton now raises ImportError
        import torch
        from kernels import ops
        k_cache = torch.zeros(4, 16, 1, 8)
        v_cache = torch.zeros(4, 16, 1, 8)
        x = torch.randn(3, 1, 8)
        ops.write_kv_cache(x, x, k_cache, v_cache, torch.tensor([0, 1, 2]))
        cache = ops.build_cos_sin_cache(8, 32, 10000.0, None, "cpu", torch.float32)
        q = torch.randn(3, 2, 8)
        ops.rotary_embedding(torch.arange(3), q, x.clone(), cache)
        tables = torch.tensor([[0]], dtype=torch.int32)
        ops.paged_attention_prefill(q, k_cache, v_cache, tables, torch.tensor([0, 3], dtype=torch.int32),
                                    torch.tensor([3], dtype=torch.int32), 0.3)
        ops.paged_attention_decode(q[:1], k_cache, v_cache, tables, torch.tensor([3], dtype=torch.int32), 0.3)
        ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(2, 8))
        assert not ops.triton_available()
        ops.set_backend("triton")
        try:
            ops.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
        except RuntimeError as err:
            assert "not installed" in str(err)
        else:
            raise AssertionError("forced triton without triton must fail")
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


def _attention_layer(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One decoder layer's kernel calls on a mixed step: a chunked prefill, then a decode step."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, group, head_dim, hidden = 16, 1, 3, 64, 96
    kv = make_paged_kv(gen, [20, 33], block_size, num_kv_heads, head_dim, dtype)
    kv.k_cache.nan_to_num_(0.0)
    kv.v_cache.nan_to_num_(0.0)
    cache = ops.build_cos_sin_cache(head_dim, 64, 10000.0, None, "cpu", torch.float32)
    x = torch.randn(13, hidden, generator=gen).to(dtype)
    residual = torch.randn(13, hidden, generator=gen).to(dtype)
    normed, residual = ops.rms_norm(x, torch.ones(hidden, dtype=dtype), 1e-5, residual)
    sizes = [num_kv_heads * group * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = (normed.float() @ torch.randn(hidden, sum(sizes), generator=gen) / 10).to(dtype)
    q, k, v = (t.reshape(13, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    # Sequence 0: prefix 12 cached, chunk of 8 (positions 12..19); sequence 1: 5 new tokens (28..32).
    positions = torch.cat([torch.arange(12, 20), torch.arange(28, 33)])
    ops.rotary_embedding(positions, q, k, cache)
    slots = torch.cat(
        [
            kv.block_tables[0, positions[:8] // block_size].long() * block_size + positions[:8] % block_size,
            kv.block_tables[1, positions[8:] // block_size].long() * block_size + positions[8:] % block_size,
        ]
    )
    ops.write_kv_cache(k, v, kv.k_cache, kv.v_cache, slots)
    start_loc = torch.tensor([0, 8, 13], dtype=torch.int32)
    prefill = ops.paged_attention_prefill(
        q, kv.k_cache, kv.v_cache, kv.block_tables, start_loc, kv.context_lens, head_dim**-0.5
    )
    decode = ops.paged_attention_decode(
        q[[7, 12]], kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5
    )
    return {"normed": normed, "q": q, "k_cache": kv.k_cache, "prefill": prefill, "decode": decode}


@pytest.mark.skipif(not interpreter_active(), reason="needs TRITON_INTERPRET=1 before triton is imported")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_on_a_layer(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    with ops.use_backend("torch"):
        expected = _attention_layer(dtype)
    with ops.use_backend("triton"):
        assert ops.resolve_backend("cpu") == "triton"
        actual = _attention_layer(dtype)
    # The last query of each chunk is the decode query of its sequence: both paths agree.
    assert rel_err(actual["decode"], actual["prefill"][[7, 12]]) < (1e-5 if dtype == torch.float32 else 1e-2)
    for name, value in expected.items():
        assert rel_err(actual[name], value) < (1e-5 if dtype == torch.float32 else 2e-2), name
