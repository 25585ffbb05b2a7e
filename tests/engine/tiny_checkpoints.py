"""Tiny random checkpoints for tests: a Hugging Face directory and a GGUF made from it.

`make_tiny_gguf` writes the file the way llama.cpp's converter does (ggml tensor names,
permuted Q/K rows for `llama`, llama3 RoPE as a `rope_freqs` tensor, metadata keys), so
loading it exercises the same paths as a real GGUF. It is written independently of
`engine.loader` on purpose: tests compare the two.

transformers is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # llama.cpp writes Mistral as llama
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def make_tiny_hf_checkpoint(
    out_dir: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    model_type: str = "llama",
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 256,
    max_shard_size: str | int | None = None,
    head_dim: int | None = None,
) -> Path:
    """Write config.json + safetensors of a random `model_type` model to `out_dir`; returns it.

    Every parameter (norms and biases too) is drawn from `seed`, so a loader that mixes up
    tensors or rows cannot pass by luck. `max_shard_size` (e.g. "100KB") makes a sharded
    checkpoint with model.safetensors.index.json. `head_dim` (llama/mistral) may differ from
    hidden_size // num_heads.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    extra: dict[str, Any] = {} if head_dim is None else {"head_dim": head_dim}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie,
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers mutates it
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def _read_hf(hf_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return config, tensors


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation: rotate-half halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for a llama3 rope_scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    orig = scaling.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def quantize_like_gguf(w: np.ndarray, qtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """(data, type) as stored for a 2-D weight; tests dequantize it to get the exact expectation."""
    gtype = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(w.astype(np.float32), gtype), gtype


def make_tiny_gguf(out_path: Path, hf_dir: Path, qtype: str = "F32") -> Path:
    """Convert the HF checkpoint at `hf_dir` to a GGUF at `out_path`, 2-D weights in `qtype`.

    qtype: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (types gguf can quantize; row
    lengths must be multiples of 32). 1-D tensors stay F32, as in llama.cpp. No tokenizer.
    """
    out_path, hf_dir = Path(out_path), Path(hf_dir)
    cfg, tensors = _read_hf(hf_dir)
    model_type = cfg["model_type"]
    arch = _GGUF_ARCH[model_type]
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))

    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(f"tiny-{model_type}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"
    w.add_file_type(gguf.LlamaFileType[file_type])
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "llama3":
        # llama.cpp itself stores only the factors; we also record the original context so
        # the tiny file fully describes its scaling.
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", 8192))
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(head_dim, theta, rope))
    elif rope_type != "default":
        raise ValueError(f"make_tiny_gguf: rope type {rope_type!r} not handled")

    for name, tensor in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = _gguf_name(name)
        data = tensor.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            data = _permute(data, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            data = _permute(data, n_kv)
        if data.ndim == 2 and qtype != "F32":
            qdata, gtype = quantize_like_gguf(data, qtype)
            w.add_tensor(gname, qdata, raw_dtype=gtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"make_tiny_gguf: no ggml name for {hf}")
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_LAYER_NAMES[module]}.{parts[-1]}"
