"""What the benchmarks read: the public data sets (ShareGPT prompts, Azure output lengths)
and the model, for the engine and for the transformers baselines. An absent input is a
`MissingInputError` whose message says how to get it."""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAREGPT_FILE = "sharegpt_v3_filtered_500.json"
AZURE_CONV_FILE = "azure2023_conv.csv"


class MissingInputError(FileNotFoundError):
    """Benchmark input (shared data or the model) is absent; the message says how to get it."""


def data_dir() -> Path:
    """The shared public data folder (`../shared/data` from the repo root, or $FLEET_SHARED_DATA)."""
    return Path(os.environ.get("FLEET_SHARED_DATA", ROOT.parent / "shared" / "data"))


def require_data_file(name: str) -> Path:
    path = data_dir() / name
    if not path.is_file():
        raise MissingInputError(
            f"benchmark data {path} is absent: the benchmarks read the public data set in "
            f"../shared/data (see its README.md); set FLEET_SHARED_DATA to another folder holding {name}"
        )
    return path


def load_sharegpt_prompts(path: Path | None = None) -> list[str]:
    """First human turn of every ShareGPT conversation, in file order (empty turns dropped)."""
    path = path or require_data_file(SHAREGPT_FILE)
    with path.open(encoding="utf-8") as f:
        convs = json.load(f)
    prompts: list[str] = []
    for conv in convs:
        turn = next((t for t in conv.get("conversations", []) if t.get("from") == "human"), None)
        if turn is not None and turn.get("value", "").strip():
            prompts.append(turn["value"])
    return prompts


def load_azure_output_lengths(
    n: int, seed: int, path: Path | None = None, lo: int = 16, hi: int = 256
) -> list[int]:
    """`n` real chat output lengths (GeneratedTokens), clipped to [lo, hi], sampled with `seed`."""
    path = path or require_data_file(AZURE_CONV_FILE)
    with path.open(encoding="utf-8", newline="") as f:
        lengths = [min(hi, max(lo, int(row["GeneratedTokens"]))) for row in csv.DictReader(f)]
    if n > len(lengths):
        raise ValueError(f"asked for {n} output lengths but {path} has only {len(lengths)} rows")
    return random.Random(seed).sample(lengths, n)


# --------------------------------------------------------------------------- model


def resolve_model(model: str) -> Path:
    """The model file, with a missing model reported as a missing benchmark input."""
    from engine.model_files.aliases import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(model)
    except ModelNotFoundError as err:
        raise MissingInputError(str(err)) from err


def _hf_source(path: Path) -> tuple[Path, dict[str, Any]]:
    if path.is_file():
        return path.parent, {"gguf_file": path.name}
    return path, {}


def load_hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    source, kwargs = _hf_source(path)
    return AutoTokenizer.from_pretrained(source, **kwargs)


def load_hf_model(path: Path, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    source, kwargs = _hf_source(path)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval()


def encode(tokenizer: Any, text: str) -> list[int]:
    """Plain text -> ids; transformers' and the engine's tokenizers both speak this."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_token_ids(tokenizer: Any, user: str, system: str | None = None) -> list[int]:
    """Token ids of one user turn under the model's chat template, ready for the assistant.

    Takes a transformers tokenizer (what the scripts use, so every system gets the reference
    tokenization) or the engine's own (what the smoke tests use, to skip a slow load)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    if hasattr(tokenizer, "encode_chat"):
        return list(tokenizer.encode_chat(messages, add_generation_prompt=True))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return encode(tokenizer, text)  # the template already spells out the special tokens
