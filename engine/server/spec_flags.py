"""Server flags for speculative decoding, in vLLM's words.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'`
is vLLM's own flag; `--speculative ngram` with `--num-speculative-tokens`, `--prompt-lookup-max`
and `--prompt-lookup-min` (also `--ngram-max` / `--ngram-min`) set the same fields one by one
and win over the JSON. Off unless one of them is given.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import ValidationError

from engine.spec_decode.config import SpeculativeConfig

_FIELDS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speculative-config is not JSON: {text!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--speculative-config must be a JSON object")
    return obj


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (vLLM's names; off by default)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON")
    g.add_argument("--speculative", choices=["ngram"], default=None, help="drafting method (n-gram lookup)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens per step (k)")
    g.add_argument("--prompt-lookup-max", "--ngram-max", dest="prompt_lookup_max", type=int, default=None)
    g.add_argument("--prompt-lookup-min", "--ngram-min", dest="prompt_lookup_min", type=int, default=None)


def speculative_config(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """The setting the flags ask for (None: off); bad values raise a ValueError naming them."""
    fields: dict[str, Any] = dict(ns.speculative_config or {})
    if ns.speculative is not None:
        fields["method"] = ns.speculative
    fields.update({k: getattr(ns, k) for k in _FIELDS if getattr(ns, k) is not None})
    if not fields:
        return None
    if "method" not in fields:
        raise ValueError("speculative decoding flags need --speculative ngram (or a method in the JSON)")
    try:
        return SpeculativeConfig(**fields)
    except ValidationError as err:
        raise ValueError(f"bad speculative decoding setting: {err}") from None
