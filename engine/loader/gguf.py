"""GGUF (llama.cpp) -> ModelConfig + a dequantized state dict in Hugging Face Llama names.

llama.cpp runs Llama with interleaved-pair RoPE, so its converter permutes the rows of the
Q and K projections of `llama`-arch models; the engine uses HF's rotate-half RoPE, so those
rows are permuted back here. Qwen2 GGUFs use NeoX RoPE in llama.cpp and are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from engine.config import ModelConfig
from engine.loader.names import check_state_dict_shapes, expected_shapes
from engine.loader.rope_scaling import (
    LLAMA_CPP_DEFAULT_ORIGINAL_CONTEXT,
    SUPPORTED_ROPE_TYPES,
    llama3_scaling_from_factors,
)
from engine.model_files.errors import CheckpointError
from engine.model_files.gguf import GGUFFile, GGUFTensorInfo


@dataclass(frozen=True)
class ArchTraits:
    qk_permuted: bool  # llama.cpp permuted Q/K rows for interleaved RoPE


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(qk_permuted=True),
    "mistral": ArchTraits(qk_permuted=True),
    "qwen2": ArchTraits(qk_permuted=False),
}

ROPE_FREQS = "rope_freqs.weight"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """ggml tensor name -> Hugging Face name (None when the engine has no such tensor)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


# ---------------------------------------------------------------- metadata -> ModelConfig


def _uniform(value: Any, key: str, where: Path) -> int:
    """A per-model count; llama.cpp may store per-layer arrays, which must all agree here."""
    if isinstance(value, (np.ndarray, list)):
        values = {int(v) for v in value}
        if len(values) != 1:
            raise CheckpointError(f"{where}: {key} varies per layer ({sorted(values)}); not supported")
        return values.pop()
    return int(value)


def _rope_scaling(f: GGUFFile, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    md = f.metadata
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if ROPE_FREQS in f.tensors:
        info = f.tensors[ROPE_FREQS]
        factors = _to_torch(_dequantize(f, info), info.qtype, torch.float32).numpy()
        return llama3_scaling_from_factors(
            factors,
            head_dim,
            theta,
            int(orig) if orig else LLAMA_CPP_DEFAULT_ORIGINAL_CONTEXT,
            where=f"{f.path}: {ROPE_FREQS}",
        )
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor", md.get(f"{arch}.rope.scale_linear"))
    if kind in (None, "none") and factor is None:
        return None
    if kind is None and factor is not None:
        kind = "linear"  # older files: `rope.scale_linear` only
    if kind == "none" or (kind == "linear" and float(factor or 1.0) == 1.0):
        return None
    if kind != "linear":
        raise CheckpointError(
            f"{f.path}: RoPE scaling type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return {"rope_type": "linear", "factor": float(factor)}


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """ModelConfig from the metadata and the tensor directory (no tensor data but rope_freqs)."""
    md = f.metadata
    arch = md.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{f.path}: GGUF metadata has no general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{f.path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if int(md.get("split.count", 1)) > 1:
        raise CheckpointError(f"{f.path}: split GGUF files are not supported; merge them with gguf-split")
    if int(md.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise CheckpointError(f"{f.path}: mixture-of-experts models are not supported")

    def req(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise CheckpointError(f"{f.path}: GGUF metadata lacks {full}")
        return md[full]

    hidden = int(req("embedding_length"))
    n_heads = _uniform(req("attention.head_count"), "attention.head_count", f.path)
    n_kv = _uniform(md.get(f"{arch}.attention.head_count_kv", n_heads), "attention.head_count_kv", f.path)
    head_dim = int(
        md.get(f"{arch}.attention.key_length") or md.get(f"{arch}.rope.dimension_count") or hidden // n_heads
    )
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{f.path}: missing tensor token_embd.weight")
    return ModelConfig(
        architecture=arch,
        vocab_size=embd.shape[0],
        hidden_size=hidden,
        intermediate_size=_uniform(req("feed_forward_length"), "feed_forward_length", f.path),
        num_hidden_layers=int(req("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        rope_scaling=_rope_scaling(f, arch, head_dim, theta),
        max_position_embeddings=int(md.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
    )


# ---------------------------------------------------------------- tensors


@cache
def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return True
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _dequantize(f: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as a numpy array (float32 for quantized blocks); may be a read-only file view.

    Unpermuting is done in numpy, not torch: on a busy two-core machine torch's intra-op threads
    make these small strided copies ~50x slower.
    """
    raw = f.raw(info)
    qtype = info.qtype
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16)
    if qtype == GGMLQuantizationType.BF16:
        return raw.view(np.int16)  # reinterpreted as bfloat16 in _to_torch
    if not _can_dequantize(qtype):
        raise CheckpointError(
            f"{f.path}: tensor {info.name} has GGML type {qtype.name}, which the gguf package "
            "cannot dequantize"
        )
    return gguf.quants.dequantize(raw, qtype)


def _to_torch(arr: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor of `dtype` that owns its memory (never a view of the mapped file)."""
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, order="C")
    t = torch.from_numpy(arr)
    if qtype == GGMLQuantizationType.BF16:
        t = t.view(torch.bfloat16)
    return t.to(dtype)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF rotate-half halves).

    llama.cpp maps HF row h*D + s*D/2 + j (s in {0, 1}) to row h*D + 2*j + s; this is the inverse.
    """
    rows = w.shape[0]
    split = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(w.shape)


def _load_one(
    f: GGUFFile, info: GGUFTensorInfo, config: ModelConfig, permuted: bool, dtype: torch.dtype
) -> tuple[str, torch.Tensor]:
    name = hf_name(info.name)
    assert name is not None
    arr = _dequantize(f, info)
    if permuted and ".self_attn.q_proj." in name:
        arr = unpermute_qk(arr, config.num_attention_heads)
    elif permuted and ".self_attn.k_proj." in name:
        arr = unpermute_qk(arr, config.num_key_value_heads)
    return name, _to_torch(arr, info.qtype, dtype)


def _weight_infos(f: GGUFFile, config: ModelConfig) -> list[GGUFTensorInfo]:
    """The tensors to load, checked for names, shapes and types before any data is read."""
    shapes: dict[str, tuple[int, ...]] = {}
    infos = []
    for info in f.tensors.values():
        if info.name == ROPE_FREQS:
            continue
        name = hf_name(info.name)
        if name is None:
            raise CheckpointError(
                f"{f.path}: unexpected tensor {info.name} (not used by the engine's Llama model)"
            )
        if not _can_dequantize(info.qtype):
            raise CheckpointError(
                f"{f.path}: tensor {info.name} has GGML type {info.qtype.name}, which the gguf "
                "package cannot dequantize"
            )
        shapes[name] = info.shape
        infos.append(info)
    check_state_dict_shapes(shapes, expected_shapes(config), str(f.path))
    return infos


def read_gguf_config(path: str | Path) -> ModelConfig:
    with GGUFFile(path) as f:
        return config_from_gguf(f)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, show_progress: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize every weight of a GGUF file into a CPU state dict of `dtype`."""
    with GGUFFile(path) as f:
        config = config_from_gguf(f)
        infos = _weight_infos(f, config)
        permuted = ARCHITECTURES[config.architecture].qk_permuted
        state: dict[str, torch.Tensor] = {}
        # numpy dequantization and torch copies release the GIL: two threads roughly halve the time.
        with ThreadPoolExecutor(max_workers=2) as pool:
            results: Iterator[tuple[str, torch.Tensor]] = pool.map(
                lambda info: _load_one(f, info, config, permuted, dtype), infos
            )
            for name, tensor in tqdm(
                results, total=len(infos), desc="Loading weights", unit="tensor", disable=not show_progress
            ):
                state[name] = tensor
    return config, state
