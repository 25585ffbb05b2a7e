"""Linear-layer weight formats: keep weights small where the matmul reads them every step.

At batch 1 a decode step reads every weight once, so bytes per weight bound its time.
`convert_linears(model, fmt)` swaps each decoder `nn.Linear` (q/k/v, o, gate/up, down) for a
module holding the weight in `fmt`; embeddings, norms and the (tied) LM head stay as they
are, so the logits keep their precision.

- `bf16`: weight in bfloat16, activations cast at the matmul, result back in the model dtype.
- `int8`: per-output-channel symmetric int8 with `torch._weight_int8pack_mm` (weight-only).
- `int4`: group-wise (`INT4_GROUP` columns) asymmetric 4-bit with
  `torch._weight_int4pack_mm_for_cpu` (bfloat16 activations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 64
FORMATS = ("fp32", "bf16", "int8", "int4")


class Bf16Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int8Linear(nn.Module):
    """w ~= q * scale per output row; q int8 in [-127, 127]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        out = torch._weight_int8pack_mm(x2, self.qweight, self.scale).to(x.dtype)
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    """Per group of INT4_GROUP input columns: w ~= (q - 8) * scale + zero, q in [0, 15]."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        w = linear.weight.detach().float().contiguous()
        n, k = w.shape
        if k % group:
            raise ValueError(f"int4 weights need in_features divisible by {group}, got {k}")
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8.0 * scale
        self.group = group
        self.out_features = n
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [k/group, n, 2]
        self.register_buffer("scales_zeros", sz.to(torch.bfloat16))
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def column_major(model: nn.Module) -> int:
    """Store every float `nn.Linear` weight, and a tied embedding, as the transpose of a
    contiguous [in, out] matrix; returns how many were changed.

    F.linear then hands MKL a plain [in, out] operand instead of a transposed one, which on
    this CPU runs small-batch products markedly faster (the LM head at batch 1 most of all;
    docs/engine.md "Step profile"). Values are unchanged; only the summation order of a
    product may differ, as between any two BLAS paths. Embedding lookups read strided rows,
    a negligible cost next to the matmuls of the same tokens.
    """
    modules: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Linear)]
    tied = getattr(model, "embed_tokens", None)
    if tied is not None and getattr(model, "lm_head", False) is None:  # the embedding is the LM head
        modules.append(tied)
    count = 0
    for module in modules:
        weight = module.weight
        if weight.dim() == 2 and weight.is_floating_point() and weight.is_contiguous():
            module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)
            count += 1
    return count


_MODULES: dict[str, type[nn.Module]] = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int4Linear}


def convert_linears(model: nn.Module, fmt: str) -> int:
    """Replace every `nn.Linear` inside the decoder layers by the `fmt` module; returns how many."""
    if fmt == "fp32":
        return 0
    if fmt not in _MODULES:
        raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")
    cls = _MODULES[fmt]
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("the model has no decoder layers to convert")
    count = 0
    for layer in layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, cls(child))
                    count += 1
    return count
