"""The host tier's bytes: one slot per KV block in host memory, and the copies between a
slot and a block of the device KV cache (`engine.kv_cache.host_tier` keeps the index).

Copies run in the order given (an offload into a slot may precede a load from it). On CUDA
the slots are pinned and the copies are queued on a side stream without blocking the host;
the compute stream waits for them before the step's kernels, which may overwrite an
offloaded block or read a loaded one. On CPU the same calls copy synchronously.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import KvTransfer


class HostKVBuffer:
    def __init__(self, device_cache: torch.Tensor, num_slots: int) -> None:
        """`device_cache`: [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        self.device_cache = device_cache
        layers, two, _, bs, heads, dim = device_cache.shape
        cuda = device_cache.device.type == "cuda"
        # Slot-major, so one slot is contiguous (one DMA per block on CUDA).
        self.slots = torch.empty(
            (num_slots, layers, two, bs, heads, dim), dtype=device_cache.dtype, pin_memory=cuda
        )
        self.stream = torch.cuda.Stream(device_cache.device) if cuda else None

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def copy(self, transfers: Sequence[KvTransfer]) -> None:
        """Perform `transfers` in order; on CUDA, queued so the compute stream waits for them."""
        if not transfers:
            return
        if self.stream is None:
            self._copy(transfers, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.device_cache.device)
        self.stream.wait_stream(compute)  # offloads read what earlier steps wrote
        with torch.cuda.stream(self.stream):
            self._copy(transfers, non_blocking=True)
        compute.wait_stream(self.stream)

    def _copy(self, transfers: Sequence[KvTransfer], non_blocking: bool) -> None:
        dev, host = self.device_cache, self.slots
        for t in transfers:
            if t.kind == "offload":
                host[t.slot].copy_(dev[:, :, t.block_id], non_blocking=non_blocking)
            else:
                dev[:, :, t.block_id].copy_(host[t.slot], non_blocking=non_blocking)
