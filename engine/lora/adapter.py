"""One PEFT LoRA adapter read from disk: adapter_config.json + adapter_model.safetensors.

Checked against the base model before it is accepted: the rank fits the engine's slots, every
target is a projection the engine adapts (q/k/v/o, gate/up/down) and every tensor has the
shape the base's layer needs. Anything else is a `LoRAAdapterError` (a 400 at the API).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ModelConfig

# PEFT module name -> (fused group in our model, index within that group)
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this base (bad path, format, rank or targets)."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every adaptable projection of the base."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(eq=False)
class LoRAAdapter:
    """A registered adapter. `weights` (CPU, scaling folded into B) may be dropped by the CPU
    LRU and read again from `path`; `uid` is the content hash that keys its prefix cache."""

    name: str
    path: str
    uid: str
    rank: int
    scale: float
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)
    load_seconds: float = 0.0

    @property
    def groups(self) -> frozenset[str]:
        return frozenset(MODULES[m][0] for m in self.targets)


def _read_config(root: Path) -> dict:
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"no {CONFIG_FILE} in {root}") from None
    except (OSError, ValueError) as err:
        raise LoRAAdapterError(f"cannot read {root / CONFIG_FILE}: {err}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise LoRAAdapterError(f"{key} adapters are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError("modules_to_save (full copies of base modules) is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAAdapterError("per-module rank_pattern / alpha_pattern is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError("LoRA bias training (bias != 'none') is not supported")
    return cfg


def _content_id(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def load_peft_adapter(
    name: str, path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and validate an adapter directory; its weights come back on the CPU in `dtype`."""
    import time

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise LoRAAdapterError(f"adapter path {str(path)!r} is not a directory")
    conf = _read_config(root)
    rank, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(f"adapter rank {rank} exceeds this server's --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"lora_alpha={alpha!r} is not a number")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    targets_conf = conf.get("target_modules")
    if isinstance(targets_conf, list):
        bad = sorted(set(targets_conf) - set(MODULES))
        if bad:
            raise LoRAAdapterError(
                f"target modules {bad} are not adaptable here (supported: {sorted(MODULES)})"
            )
    weights_file = root / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(f"no {WEIGHTS_FILE} in {root}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as err:
        raise LoRAAdapterError(f"cannot read {weights_file}: {err}") from None

    weights = {
        where: (ab["A"].to(dtype), (ab["B"].float() * scale).to(dtype))
        for where, ab in _pairs(tensors, cfg, rank, weights_file).items()
    }
    return LoRAAdapter(
        name=name,
        path=str(root),
        uid=_content_id(weights_file),
        rank=rank,
        scale=float(scale),
        targets=frozenset(m for _, m in weights),
        weights=weights,
        load_seconds=time.perf_counter() - t0,
    )


def _pairs(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, weights_file: Path
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module) -> {"A", "B"}, every name and shape checked against the base."""
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"tensor {key!r} is not a LoRA A/B of a decoder projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoRAAdapterError(f"tensor {key!r} adapts {module!r}, which this engine cannot adapt")
        if layer >= cfg.num_hidden_layers:
            raise LoRAAdapterError(f"tensor {key!r}: the base has {cfg.num_hidden_layers} layers")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(t.shape) != want:
            raise LoRAAdapterError(
                f"tensor {key!r} has shape {tuple(t.shape)}, the base needs {want} (rank {rank})"
            )
        pairs.setdefault((layer, module), {})[which] = t
    if not pairs:
        raise LoRAAdapterError(f"{weights_file} holds no LoRA tensors")
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"layer {layer} {module}: lora_A and lora_B must both be present")
    return pairs
