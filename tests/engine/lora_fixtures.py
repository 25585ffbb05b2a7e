"""Random PEFT adapters over a tiny random Llama base, written with peft itself.

Every LoRA A and B is drawn from a seed (B is non-zero, unlike PEFT's default init), so an
adapter changes the model's greedy output and a kernel that drops or misplaces a delta fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.engine.tiny_checkpoints import make_tiny_hf_checkpoint

# name -> (rank, alpha, target modules, seed)
ADAPTERS = {
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
    "mlp4": (4, 8, ["q_proj", "gate_proj", "up_proj", "down_proj"], 2),
}


def make_tiny_base(out: Path, hidden_size: int = 128, seed: int = 3) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (the real model's files)."""
    from engine.model_files.aliases import resolve_model_path
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model_path("smollm2-135m"))
    make_tiny_hf_checkpoint(
        out,
        vocab_size=tok.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seed=seed,
        max_position_embeddings=512,
    )
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))
    return out


def make_adapter(
    out: Path, base: Path, rank: int, alpha: int, targets: list[str], seed: int, std: float = 0.2
) -> Path:
    """save_pretrained of a peft LoRA with random A and B: adapter_config.json + safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return out
