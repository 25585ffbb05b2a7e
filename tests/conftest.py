"""Shared fixtures: the real model file and the shared data folder, skipping clearly when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.hf_gguf import shared_gguf_parsing

ROOT = Path(__file__).resolve().parents[1]
# Property tests: `ci` is derandomized (the same examples every run, so CI is reproducible);
# `dev` draws fresh examples. scripts/test.sh selects `ci`; docs/testing.md has the
# `--hypothesis-seed` sweep for nightly-style runs.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

SHARED_DATA = Path(os.environ.get("FLEET_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (set FLEET_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from engine.model_files.aliases import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path("smollm2-135m")
    except ModelNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own load of the same GGUF (float32): the reference model. Slow, so
    loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    with shared_gguf_parsing():
        return AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()
