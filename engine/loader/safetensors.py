"""Hugging Face directory (config.json + *.safetensors, sharded or not) -> ModelConfig + state dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.config import ModelConfig
from engine.loader.names import check_state_dict_shapes, expected_shapes
from engine.loader.rope_scaling import normalize_hf_rope_scaling
from engine.model_files.errors import CheckpointError, CheckpointNotFoundError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Buffers some exporters save that the engine recomputes or never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def config_from_hf(raw: dict[str, Any], where: str) -> ModelConfig:
    """config.json -> ModelConfig, with the defaults transformers applies per model type."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        hidden = int(raw["hidden_size"])
        n_heads = int(raw["num_attention_heads"])
        # transformers >= 5 nests theta and scaling in `rope_parameters`; older configs keep
        # `rope_theta` and `rope_scaling` at the top level.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if model_type == "qwen2" and raw.get("use_sliding_window"):
            raise CheckpointError(f"{where}: Qwen2 sliding-window attention is not supported")
        if model_type == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
            raise CheckpointError(f"{where}: Llama attention_bias/mlp_bias are not supported")
        return ModelConfig(
            architecture=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=normalize_hf_rope_scaling(rope, where),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            # LlamaConfig, MistralConfig and Qwen2Config all default to untied embeddings.
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
        )
    except KeyError as err:
        raise CheckpointError(f"{where}: config.json lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{where}: bad value in config.json ({err})") from err


def read_hf_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    return config_from_hf(_read_json(path / "config.json"), str(path / "config.json"))


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{path}: no *.safetensors files")
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{file} (listed in {index.name}) does not exist")
    return files


def load_hf(
    path: str | Path, dtype: torch.dtype = torch.float32, show_progress: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read every shard into a CPU state dict of `dtype`, keeping only the tensors the engine uses."""
    path = Path(path)
    config = read_hf_config(path)
    expected = expected_shapes(config)
    files = _weight_files(path)
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=len(expected), desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            try:
                with safe_open(file, framework="pt", device="cpu") as sf:
                    for key in sf.keys():
                        if key.endswith(_IGNORED_SUFFIXES):
                            continue
                        if config.tie_word_embeddings and key == "lm_head.weight":
                            continue  # tied: the engine reuses embed_tokens
                        if key in state:
                            raise CheckpointError(f"{file}: tensor {key} appears in more than one shard")
                        state[key] = sf.get_tensor(key).to(dtype)
                        bar.update(1)
            except SafetensorError as err:
                raise CheckpointError(f"{file}: corrupt safetensors file ({err})") from err
    check_state_dict_shapes({k: tuple(v.shape) for k, v in state.items()}, expected, str(path))
    return config, state
