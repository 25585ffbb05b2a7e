"""A two-linear model with a tied LM head, the shape the weight-format tests convert."""

from __future__ import annotations

import torch
from torch import nn


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(300, 64)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64))])
        self.lm_head = None
        self.logits_head = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.embed_tokens(ids))
        head = self.logits_head
        return head(h) if head is not None else nn.functional.linear(h, self.embed_tokens.weight)
