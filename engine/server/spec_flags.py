"""Server flags for speculative decoding, in vLLM's words.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": 4}'`
is vLLM's own flag; `--speculative ngram` with `--num-speculative-tokens`, `--prompt-lookup-max`,
`--prompt-lookup-min` (also `--ngram-max` / `--ngram-min`) and
`--speculative-disable-by-batch-size` set the same fields one by one and win over the JSON.
`--speculative none` turns it off. Nothing given: the engine's default
(`DEFAULT_SPECULATIVE_CONFIG`), which the field flags alone adjust when it is on.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import ValidationError

from engine.spec_decode.config import DEFAULT_SPECULATIVE_CONFIG, SpeculativeConfig

# SpeculativeConfig field -> argparse dest
_FIELDS = {
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "prompt_lookup_max",
    "prompt_lookup_min": "prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {text!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    return obj


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    state = "off" if DEFAULT_SPECULATIVE_CONFIG is None else "ngram"
    g = p.add_argument_group(f"speculative decoding (vLLM's names; default {state})")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON")
    g.add_argument(
        "--speculative", choices=["ngram", "none"], default=None, help="drafting method (none: off)"
    )
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step (k)")
    g.add_argument("--prompt-lookup-max", "--ngram-max", dest="prompt_lookup_max", type=int, default=None)
    g.add_argument("--prompt-lookup-min", "--ngram-min", dest="prompt_lookup_min", type=int, default=None)
    g.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="no drafting in a step where N or more sequences decode",
    )


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """The setting the flags ask for (None: off); bad values raise a ValueError naming them."""
    fields: dict[str, Any] = dict(ns.speculative_config or {})
    fields.update({k: getattr(ns, d) for k, d in _FIELDS.items() if getattr(ns, d) is not None})
    if ns.speculative == "none":
        if fields:
            raise ValueError("--speculative none turns speculative decoding off; drop its other flags")
        return None
    if ns.speculative is not None:
        fields["method"] = ns.speculative
    if not fields:
        return DEFAULT_SPECULATIVE_CONFIG
    if "method" not in fields:
        if DEFAULT_SPECULATIVE_CONFIG is None:
            raise ValueError("speculative decoding flags need --speculative ngram (or a method in the JSON)")
        fields = {**DEFAULT_SPECULATIVE_CONFIG.model_dump(), **fields}
    try:
        return SpeculativeConfig(**fields)
    except ValidationError as err:
        raise ValueError(f"bad speculative decoding setting: {err}") from None
