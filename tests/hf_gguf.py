"""Loading a GGUF with Hugging Face transformers (the reference the engine is checked
against) without paying its redundant parsing."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator


@contextlib.contextmanager
def shared_gguf_parsing() -> Iterator[None]:
    """transformers parses a GGUF's metadata (SmolLM2's 49k-token vocabulary, element by
    element) afresh for each step of one load, and rebuilds gguf's tensor-name map for every
    submodule: most of the load's time. Both are pure functions of their arguments, so
    within one load they are computed once; the weights, config and tokenizer are unchanged."""
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
