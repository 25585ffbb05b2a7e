"""The one dispatch point the engine calls: PyTorch references or Triton kernels.

Backends: "torch" (references, any device), "triton" (Triton kernels; on CPU tensors only
through Triton's interpreter, TRITON_INTERPRET=1) and "auto" (Triton on CUDA tensors when
Triton is installed, the references everywhere else). Triton is imported on first use of
the triton backend, so CPU-only processes never load it.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal, cast

import torch
from torch import Tensor

from kernels import reference
from kernels.triton_mode import interpret_requested, interpreter_active

Backend = Literal["auto", "torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("auto", "torch", "triton")

_backend: Backend = "auto"
_modules: dict[str, ModuleType] = {}
_warned_no_triton = False


def set_backend(name: str) -> None:
    """Select the backend for every later call (process-wide)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _backend = cast(Backend, name)


def get_backend() -> Backend:
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Temporarily switch the backend (tests, benchmarks)."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(device: torch.device | str) -> Literal["torch", "triton"]:
    """The implementation that runs for tensors on `device` under the current backend setting."""
    global _warned_no_triton
    device = torch.device(device)
    if _backend == "torch":
        return "torch"
    if _backend == "auto":
        if device.type != "cuda":
            return "torch"
        if not triton_available():
            if not _warned_no_triton:
                warnings.warn("triton is not installed: CUDA falls back to the PyTorch kernels", stacklevel=3)
                _warned_no_triton = True
            return "torch"
        return "triton"
    if not triton_available():
        raise RuntimeError("the triton kernel backend was requested but triton is not installed")
    if device.type != "cuda" and not interpreter_active():
        if interpret_requested():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton had been imported in compiled mode; "
                "set it in the environment before the process first imports triton"
            )
        raise RuntimeError(
            f"the triton kernel backend on {device.type} tensors needs Triton's interpreter: "
            "start the process with TRITON_INTERPRET=1 (slow; for tests), or use the 'torch'/'auto' backend"
        )
    return "triton"


def _triton(module: str) -> ModuleType:
    if module not in _modules:
        _modules[module] = importlib.import_module(f"kernels.{module}")
    return _modules[module]


def _impl(device: torch.device, module: str) -> Any:
    if _backend == "torch" or (_backend == "auto" and device.type != "cuda"):  # the per-call fast path
        return reference
    return reference if resolve_backend(device) == "torch" else _triton(module)


def write_kv_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, plan: Any = None
) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T] (negative = skip).

    `plan`: this step's `plan_kv_write(slot_mapping)`, or None."""
    if plan is not None:
        reference.write_kv_planned(key, value, k_cache, v_cache, plan)
        return
    _impl(key.device, "triton_cache").write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def plan_kv_write(slot_mapping: Tensor) -> Any:
    """The step's KV write targets for the reference path, shared by every layer (the negative
    slots dropped once); None where the backend needs none (Triton)."""
    if resolve_backend(slot_mapping.device) != "torch":
        return None
    return reference.plan_kv_write(slot_mapping)


def plan_paged_decode(block_tables: Tensor, context_lens: Tensor, block_size: int) -> Any:
    """Per-step bookkeeping every layer's decode attention shares (the reference's gather
    layout), built once per step; None where the backend needs none (Triton)."""
    if resolve_backend(block_tables.device) != "torch":
        return None
    return reference.plan_decode(block_tables, context_lens, block_size)


def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    plan: Any = None,
) -> Tensor:
    """q [B, Hq, D], block_tables [B, max_blocks] int32, context_lens [B] int32 -> [B, Hq, D].

    `plan`: this step's `plan_paged_decode` for these tables, or None."""
    if plan is not None:
        return reference.decode_attention(q, k_cache, v_cache, plan, scale)
    impl = _impl(q.device, "triton_attention")
    return impl.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_attention_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    context_lens: Tensor,
    scale: float,
) -> Tensor:
    """q [T, Hq, D] of S chunks (query_start_loc [S+1]), context_lens [S] incl. the chunk -> [T, Hq, D]."""
    impl = _impl(q.device, "triton_attention")
    return impl.paged_attention_prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
    )


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """rmsnorm(x) or, with residual, (rmsnorm(x + residual), x + residual)."""
    return _impl(x.device, "triton_norm_rope").rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: Tensor, q: Tensor, k: Tensor | None, cos_sin_cache: Tensor, angles: Any = None
) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D]; cos_sin_cache [max_pos, rot_dim] = cat(cos, sin).

    `angles`: this step's `prepare_rotary`, or None; with angles, k may be None when q is one
    view over the query and key heads together."""
    if angles is not None:
        reference.rotary_embedding(positions, q, k, cos_sin_cache, angles)
        return
    _impl(q.device, "triton_norm_rope").rotary_embedding(positions, q, k, cos_sin_cache)


def prepare_rotary(positions: Tensor, cos_sin_cache: Tensor) -> Any:
    """The step's rotary angles for the reference path, shared by every layer; None where the
    backend reads the cache itself (Triton)."""
    if resolve_backend(positions.device) != "torch":
        return None
    return reference.rotary_angles(positions, cos_sin_cache)


def build_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    rotary_dim: int | None = None,
) -> Tensor:
    """[max_position, rot_dim] = cat(cos, sin); HF rope_scaling None, "linear" or "llama3"."""
    return reference.build_cos_sin_cache(head_dim, max_position, theta, scaling, device, dtype, rotary_dim)


def lora_shrink(
    x: Tensor, a_stack: Tensor, token_slots: Tensor, groups: list[tuple[int, Tensor | None]] | None = None
) -> Tensor:
    """Multi-LoRA shrink: x [T, in], A [S, R, in], token_slots [T] int64 (-1 = base) -> [T, R]."""
    return _impl(x.device, "triton_lora").lora_shrink(x, a_stack, token_slots, groups)


def lora_expand(
    h: Tensor,
    b_stack: Tensor,
    token_slots: Tensor,
    y: Tensor,
    offset: int = 0,
    groups: list[tuple[int, Tensor | None]] | None = None,
) -> None:
    """Multi-LoRA expand, in place: y[:, offset:offset+out] += h @ B[slot].T (B [S, out, R])."""
    _impl(h.device, "triton_lora").lora_expand(h, b_stack, token_slots, y, offset, groups)


def lora_groups(token_slots: Tensor) -> list[tuple[int, Tensor | None]]:
    """The reference's per-adapter row groups, built once per step (the Triton path ignores them)."""
    return reference.lora_groups(token_slots)
