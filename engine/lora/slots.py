"""The device-resident adapters, stacked so one kernel call serves every adapter in a batch.

For each layer and fused projection group (qkv, o, gate_up, down) there is one A stack
[S, n_sub * R, in] (the sub-modules' A side by side, so one shrink covers q, k and v) and
one B stack [S, out, n_sub * R] holding each sub-module's B block-diagonally at its column
range of the fused output, so one expand adds every sub-module's delta. R is the largest
rank allowed; a smaller adapter is zero-padded, which adds exact zeros, and modules an
adapter does not target stay zero.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.lora.adapter import MODULES, LoRAAdapter, module_shapes

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots:
    def __init__(
        self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        shapes = module_shapes(cfg)
        # Row offset of each sub-module inside its group's fused output.
        self.offsets: dict[str, list[int]] = {}
        width: dict[str, int] = {}
        for group, subs in GROUPS.items():
            offs, at = [], 0
            for m in subs:
                offs.append(at)
                at += shapes[m][1]
            self.offsets[group], width[group] = offs, at
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_hidden_layers):
            a_layer, b_layer = {}, {}
            for group, subs in GROUPS.items():
                ranks = len(subs) * max_rank
                fan_in = shapes[subs[0]][0]
                a_layer[group] = torch.zeros(num_slots, ranks, fan_in, dtype=dtype, device=device)
                b_layer[group] = torch.zeros(num_slots, width[group], ranks, dtype=dtype, device=device)
            self.a.append(a_layer)
            self.b.append(b_layer)

    @property
    def bytes(self) -> int:
        tensors = [t for stacks in (self.a, self.b) for layer in stacks for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` (its CPU weights must be present) into `slot`, clearing what was there."""
        assert adapter.weights is not None
        r = self.max_rank
        for a_layer, b_layer in zip(self.a, self.b):
            for group in GROUPS:
                a_layer[group][slot].zero_()
                b_layer[group][slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            group, idx = MODULES[module]
            rank, out = a.shape[0], b.shape[0]
            row = self.offsets[group][idx]
            self.a[layer][group][slot, idx * r : idx * r + rank].copy_(a)
            self.b[layer][group][slot, row : row + out, idx * r : idx * r + rank].copy_(b)
