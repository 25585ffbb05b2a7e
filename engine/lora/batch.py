"""A step's LoRA view: the slot of every flat token, and the deltas it adds in each layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.slots import LoRASlots
from kernels import ops


@dataclass
class LoRABatch:
    """Built once per step by the runner; the model's projections call `apply`."""

    slots: LoRASlots
    token_slots: torch.Tensor  # [T] int64, -1 = base model
    groups: list[tuple[int, torch.Tensor | None]]  # the reference kernels' per-adapter rows
    active: frozenset[str]  # projection groups some adapter in this step targets

    @classmethod
    def build(cls, slots: LoRASlots, token_slots: list[int], active: frozenset[str], device) -> LoRABatch:
        t = torch.tensor(token_slots, dtype=torch.int64, device=device)
        return cls(slots, t, ops.lora_groups(t), active)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (the base projection's output of x, fused sub-modules side by side) += the deltas."""
        if group not in self.active:
            return
        h = ops.lora_shrink(x, self.slots.a[layer][group], self.token_slots, self.groups)
        ops.lora_expand(h, self.slots.b[layer][group], self.token_slots, y, 0, self.groups)
