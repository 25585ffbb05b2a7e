"""Reusable scratch buffers for the CPU reference kernels.

The CPU allocator maps large buffers fresh on every request, so a decode step that gathers
hundreds of megabytes of KV per layer spends more time in page faults than in copying.
Buffers here are kept per thread (the engine loop and test threads never share one) and
grow to the largest size asked for. CUDA has a caching allocator, so it gets plain tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_local = threading.local()


def _buffers() -> dict[tuple[str, torch.dtype, torch.device], torch.Tensor]:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    return buffers


def scratch(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous uninitialized tensor of `shape`; the previous one of the same `name` becomes invalid."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= size
    key = (name, dtype, device)
    buffers = _buffers()
    buf = buffers.get(key)
    # A buffer made under torch.inference_mode (the engine's step) cannot be written in place
    # outside it (tests, autograd users): make a fresh one then.
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or buf.numel() < numel or stale:
        buf = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def release_scratch() -> None:
    """Drop this thread's buffers (e.g. after a large batch, to give the memory back)."""
    _buffers().clear()
