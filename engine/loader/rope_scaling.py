"""RoPE scaling in Hugging Face form, from config.json dicts or llama.cpp's `rope_freqs` factors.

The engine takes HF-style dicts only: {"rope_type": "linear", "factor": f} or
{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
"original_max_position_embeddings"}. Anything else is refused here, at load time, rather
than silently run with the wrong positions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.model_files.errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("linear", "llama3")
# llama.cpp's converter writes llama3 factors computed with this original context length
# (it reads `original_max_position_embeddings` from the top level of config.json, where
# Llama 3.x configs do not have it), and does not record the value in the metadata.
LLAMA_CPP_DEFAULT_ORIGINAL_CONTEXT = 8192


def normalize_hf_rope_scaling(raw: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """config.json `rope_scaling` / `rope_parameters` -> the engine's dict (None for plain RoPE)."""
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: RoPE scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if "factor" not in raw:
        raise CheckpointError(f"{where}: RoPE scaling {rope_type!r} has no 'factor'")
    out: dict[str, Any] = {"rope_type": rope_type, "factor": float(raw["factor"])}
    if rope_type == "llama3":
        out["low_freq_factor"] = float(raw.get("low_freq_factor", 1.0))
        out["high_freq_factor"] = float(raw.get("high_freq_factor", 4.0))
        out["original_max_position_embeddings"] = int(
            raw.get("original_max_position_embeddings", LLAMA_CPP_DEFAULT_ORIGINAL_CONTEXT)
        )
    return out


def llama3_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of the llama3 rule (what llama.cpp stores as `rope_freqs`)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def _nice(x: float) -> float:
    """Round away float32 noise of a recovered parameter (1.0000003 -> 1.0)."""
    return float(f"{x:.5g}")


def llama3_scaling_from_factors(
    factors: np.ndarray,
    head_dim: int,
    theta: float,
    original_max_position: int = LLAMA_CPP_DEFAULT_ORIGINAL_CONTEXT,
    where: str = "rope_freqs",
) -> dict[str, Any] | None:
    """Recover the llama3 parameters from llama.cpp's per-frequency factors.

    In the llama3 rule the blend `smooth` is linear in 1/wavelength: smooth = a/wavelen - b with
    a = orig/(high-low), b = low/(high-low). So (factor, a, b) fix every frequency, and for a
    given original context length `orig` there is exactly one (low, high). We fit a and b on the
    blended frequencies, then check that the result reproduces every factor.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise CheckpointError(f"{where}: {factors.shape[0]} RoPE factors for head_dim {head_dim}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    if factor <= 1.0 or factors.min() < 1.0 - 1e-6:
        raise CheckpointError(f"{where}: RoPE factors are not of the llama3 kind")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    eps = 1e-5
    blended = (smooth > eps) & (smooth < 1 - eps)
    if blended.sum() >= 2:
        a, neg_b = np.polyfit(x[blended], smooth[blended], 1)
        b = -neg_b
    else:
        # Too few blended frequencies to fit: put the ramp between the nearest unscaled and
        # fully scaled frequencies (any ramp there reproduces the same factors).
        ones, fulls = x[smooth >= 1 - eps], x[smooth <= eps]
        x_hi = ones.min() if ones.size else x.max() * 2
        x_lo = fulls.max() if fulls.size else x.min() / 2
        if blended.any():
            xs, s = x[blended][0], smooth[blended][0]
            a = s / (xs - x_lo)
        else:
            a = 1.0 / (x_hi - x_lo)
        b = a * x_lo
    if a <= 0:
        raise CheckpointError(f"{where}: RoPE factors are not of the llama3 kind")
    orig = int(original_max_position)
    low = b * orig / a
    high = (b + 1) * orig / a
    scaling = {
        "rope_type": "llama3",
        "factor": _nice(factor),
        "low_freq_factor": _nice(low),
        "high_freq_factor": _nice(high),
        "original_max_position_embeddings": orig,
    }
    if not np.allclose(llama3_factors(head_dim, theta, scaling), factors, rtol=1e-3, atol=1e-4):
        raise CheckpointError(f"{where}: RoPE factors do not follow the llama3 rule")
    return scaling
