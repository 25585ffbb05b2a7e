"""Split-K decode planning: how many context tokens each decode program covers, so that a
small batch of long sequences still fills every SM of the GPU."""

from __future__ import annotations

import torch

_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere), asked once per device."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# Split-K decode: aim for this many programs per SM (several waves, so the last, partial wave
# costs little) without making a partition shorter than MIN_PARTITION tokens. Untuned guesses:
# `python -m bench.kernels_gpu --sweep` measures alternatives on a real GPU.
PROGRAMS_PER_SM = 16
MIN_PARTITION = 256


def choose_partition(max_len: int, programs: int, block_n: int, device: torch.device) -> int:
    """Tokens per split for `programs` (sequence, KV head) pairs over contexts up to `max_len`."""
    if device.type != "cuda":
        return max(block_n, -(-max_len // block_n) * block_n)  # one split: the interpreter is slow
    wanted = max(1, min(-(-PROGRAMS_PER_SM * num_sms(device) // programs), -(-max_len // MIN_PARTITION)))
    per_split = -(-max_len // wanted)
    return -(-per_split // block_n) * block_n
