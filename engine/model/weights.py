"""Linear-layer weight formats: keep weights small where the matmul reads them every step.

At batch 1 a decode step reads every weight once, so bytes per weight bound its time.
`convert_linears(model, fmt)` swaps each decoder `nn.Linear` (q/k/v, o, gate/up, down) for a
module holding the weight in `fmt`; embeddings and norms stay as they are. Only `fp16` also
converts the (tied) LM head (`engine.model.weights_dispatch.convert_lm_head`): it is the one
format that is near-lossless, so the logits keep their precision.

- `fp16`: fbgemm's packed fp16 weights with fp32 activations and fp32 accumulation
  (`quantized::linear_dynamic_fp16`, F16C conversion in the kernel), CPU only.
- `bf16`: weight in bfloat16 (oneDNN-prepacked where the CPU has a bf16 kernel), activations
  cast once per call, result back in the model dtype.
- `int8`: fbgemm dynamic int8 (`quantized::linear_dynamic`): per-output-channel int8 weights,
  activations quantized per tensor at each call, i.e. over the whole batch, so a request's
  result depends on what else is in its batch. Opt-in only (docs/engine.md "Weights").
- `int4`: group-wise (`INT4_GROUP` columns) asymmetric 4-bit with
  `torch._weight_int4pack_mm_for_cpu` (bfloat16 activations).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 64
FORMATS = ("fp32", "fp16", "bf16", "int8", "int4")
CPU_ONLY = ("fp16", "int8", "int4")


class Bf16Linear(nn.Module):
    """bfloat16 weight, activations cast once per call, result back in the input's dtype.

    Where oneDNN has a bf16 kernel for this CPU (AVX-512 BW/VL/DQ, native dot products with
    AVX512_BF16 or AMX) the weight is prepacked once into oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`) and each call is one `mkldnn._linear_pointwise`, with no
    per-call weight reorder. Elsewhere (AVX2 only, as on the dev box) the prepack is refused
    and the weight stays a dense [out, in] bf16 matrix for `F.linear`, whose bf16 GEMM is
    emulated: correct, but far slower than fp32, so `auto` does not time it there.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        dense = weight.detach().to(torch.bfloat16).contiguous()
        self.packed = _onednn_prepack(dense)  # opaque, like Fp16Linear's: built at load, never moved
        self.register_buffer("weight", None if self.packed is not None else dense)
        self.bias = None if bias is None else bias.detach().clone()

    @classmethod
    def of(cls, linear: nn.Linear) -> Bf16Linear:
        return cls(linear.weight, linear.bias)

    @property
    def path(self) -> str:
        return "onednn-prepacked" if self.packed is not None else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        else:
            out = F.linear(rows, self.weight)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


PACK_HINT_ROWS = 64  # the row count the prepacked layout is tuned for: bf16 wins compute-bound calls


def _onednn_prepack(dense: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked bf16 weight, or None where this CPU/build has no such kernel. The
    packed product is checked against the dense one once, so a kernel that runs but
    disagrees is never used."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_HINT_ROWS)
        probe = torch.linspace(-1, 1, 2 * dense.shape[1]).reshape(2, -1).to(torch.bfloat16)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
    except (RuntimeError, NotImplementedError):
        return None
    want = F.linear(probe.float(), dense.float())
    if got.shape != want.shape or not torch.allclose(
        got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()
    ):
        return None
    return packed


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The activations as a contiguous float32 [M, K] matrix (what the fbgemm kernels take)."""
    return x.reshape(-1, x.shape[-1]).float().contiguous()


_FP16_MM = torch.ops.quantized.linear_dynamic_fp16.default  # the overload, bound once (hot path)


class Fp16Linear(nn.Module):
    """fbgemm fp16: half the bytes of fp32 per weight, fp32 activations and accumulation.

    The packed weight is an opaque fbgemm object (not a buffer): these modules are built at
    load and never saved or moved.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        b = None if bias is None else bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), b)

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp16Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # the model's rows: as is
            return _FP16_MM(x, self.packed)
        out = _FP16_MM(_rows(x), self.packed)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """fbgemm dynamic int8: w ~= q * scale per output row (q int8); activations quantized
    per tensor at each call, so results depend on the other rows of the batch."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float().contiguous()
        self.out_features = w.shape[0]
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zeros = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm's packing is not
            warnings.simplefilter("ignore", UserWarning)
            qw = torch.quantize_per_channel(w, scale, zeros, 0, torch.qint8)
        b = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack(qw, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, so the AVX2 int8 kernel's 16-bit sums cannot saturate
        out = torch.ops.quantized.linear_dynamic(_rows(x), self.packed, True)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


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


_MODULES: dict[str, Callable[[nn.Linear], nn.Module]] = {
    "fp16": Fp16Linear.of,
    "bf16": Bf16Linear.of,
    "int8": Int8Linear,
    "int4": Int4Linear,
}


def linear_in(fmt: str, linear: nn.Linear) -> nn.Module:
    """`linear` as a module holding its weight in `fmt` (fp32: itself)."""
    if fmt == "fp32":
        return linear
    if fmt not in _MODULES:
        raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")
    return _MODULES[fmt](linear)


def convert_linears(model: nn.Module, fmt: str) -> int:
    """Replace every `nn.Linear` inside the decoder layers by the `fmt` module; returns how many."""
    if fmt == "fp32":
        return 0
    if fmt not in _MODULES:
        raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")
    count = 0
    for parent, name, child in decoder_linears(model):
        setattr(parent, name, linear_in(fmt, child))
        count += 1
    return count


def decoder_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every `nn.Linear` inside the decoder layers."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("the model has no decoder layers to convert")
    found = []
    for layer in layers:
        for parent in layer.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    found.append((parent, name, child))
    return found
