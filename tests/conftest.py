"""Shared fixtures: the real model file and the shared data folder, skipping clearly when absent."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

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


@contextlib.contextmanager
def shared_gguf_parsing() -> Iterator[None]:
    """transformers parses a GGUF's metadata (SmolLM2's 49k-token vocabulary, element by
    element) afresh for each step of one load, and rebuilds gguf's tensor-name map for every
    submodule: most of the load's time. Both are pure functions of their arguments, so
    within one load they are computed once; the weights and config are unchanged."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


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
