"""The device-resident adapters, stacked so one kernel call serves every adapter in a batch.

For each layer and fused projection group (qkv, o, gate_up, down) there is one A stack
[S, n_sub * R, in] (the sub-modules' A side by side, so one shrink covers q, k and v) and
one B stack per sub-module [S, out_sub, R]. R is the largest rank allowed; a smaller adapter
is zero-padded, which adds exact zeros. Modules an adapter does not target stay zero.
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
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []
        # Column offset of each sub-module inside its group's fused output.
        self.offsets: dict[str, list[int]] = {}
        for group, subs in GROUPS.items():
            offs, at = [], 0
            for m in subs:
                offs.append(at)
                at += shapes[m][1]
            self.offsets[group] = offs
        for _ in range(cfg.num_hidden_layers):
            a_layer, b_layer = {}, {}
            for group, subs in GROUPS.items():
                fan_in = shapes[subs[0]][0]
                a_layer[group] = torch.zeros(
                    num_slots, len(subs) * max_rank, fan_in, dtype=dtype, device=device
                )
                b_layer[group] = [
                    torch.zeros(num_slots, shapes[m][1], max_rank, dtype=dtype, device=device) for m in subs
                ]
            self.a.append(a_layer)
            self.b.append(b_layer)

    @property
    def bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for layer in self.a for t in layer.values())
        return n + sum(t.numel() * t.element_size() for layer in self.b for ts in layer.values() for t in ts)

    @torch.no_grad()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` (its CPU weights must be present) into `slot`, clearing what was there."""
        assert adapter.weights is not None
        r = self.max_rank
        for a_layer, b_layer in zip(self.a, self.b):
            for group in GROUPS:
                a_layer[group][slot].zero_()
                for b in b_layer[group]:
                    b[slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            group, idx = MODULES[module]
            rank = a.shape[0]
            self.a[layer][group][slot, idx * r : idx * r + rank].copy_(a)
            self.b[layer][group][idx][slot, :, :rank].copy_(b)
