"""Checkpoint loading: a .gguf file or a Hugging Face directory -> ModelConfig + state dict.

The state dict uses Hugging Face Llama names (model.embed_tokens.weight,
model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, ..., lm_head.weight unless tied), with
every tensor on the CPU in the requested dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader.gguf import load_gguf, read_gguf_config
from engine.loader.safetensors import load_hf, read_hf_config
from engine.model_files.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["CheckpointError", "CheckpointNotFoundError", "load_checkpoint", "read_model_config"]


def _kind(path: Path) -> str:
    if path.is_file():
        return "gguf"  # GGUFFile checks the magic and says so when it is not one
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise CheckpointNotFoundError(f"{path} is a directory without config.json (not a Hugging Face model)")
    raise CheckpointNotFoundError(f"checkpoint {path} does not exist")


def read_model_config(path: str | Path) -> ModelConfig:
    """The architecture numbers only; reads metadata, not weights."""
    path = Path(path).expanduser()
    return read_gguf_config(path) if _kind(path) == "gguf" else read_hf_config(path)


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, show_progress: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a .gguf file (dequantized) or a Hugging Face safetensors directory onto the CPU."""
    path = Path(path).expanduser()
    if _kind(path) == "gguf":
        return load_gguf(path, dtype=dtype, show_progress=show_progress)
    return load_hf(path, dtype=dtype, show_progress=show_progress)
