"""Shared fixtures: the real model file and the shared data folder, skipping clearly when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FLEET_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (set FLEET_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from engine.registry import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path("smollm2-135m")
    except ModelNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own load of the same GGUF (float32): the reference model. Slow (~20 s),
    so loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
