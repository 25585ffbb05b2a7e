"""Constrained decoding with xgrammar: JSON schemas compiled once to token-level grammars,
one matcher per sequence, and per step one batched bitmask for every constrained row.

Why xgrammar (over llguidance): on SmolLM2's 49k vocabulary at batch 32 its batched mask fill
measured 0.05-0.25 ms per step back to back against 5-23 ms for llguidance's parallel fill, its
tokenizer setup is ~10x cheaper, and it ships apply kernels for CPU and CUDA. With other
memory-heavy work between fills on a loaded 2-core machine the order flipped (docs/openai_api.md
has both; `bench/structured_outputs.py` measures them).

Compilation runs off the engine thread (the server compiles while admitting a request); a
schema the compiler cannot express is a `GrammarError` (a ValueError, so a 400).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from engine.timing import DurationHistogram
from fleet_base.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CACHE_SIZE = 256
_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarError(ValueError):
    """A schema the grammar compiler refuses; the message says why."""

    param = "response_format"  # the request field a client fixes (forced tool calls: their schema)


class GrammarBackend:
    """Compiles specs (LRU-cached) and fills bitmasks for a batch of matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        import xgrammar as xgr  # imported on first use: it brings transformers along (seconds)

        self._xgr = xgr
        stops = sorted(t for t in tokenizer.stop_token_ids if 0 <= t < vocab_size)
        n = min(int(tokenizer.vocab_size), vocab_size)
        vocab = list(tokenizer.token_bytes(range(n)))
        # Special tokens other than the stops are never part of JSON text: empty bytes make
        # xgrammar treat them as special (always masked); ids past the tokenizer are padding.
        for i in tokenizer.all_special_ids:
            if 0 <= i < n and i not in stops:
                vocab[i] = b""
        vocab += [b""] * (vocab_size - n)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(
            vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._cache: OrderedDict[tuple[str, str | None], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compile_seconds = DurationHistogram(COMPILE_BUCKETS)
        self.mask_seconds = DurationHistogram(MASK_BUCKETS)
        self.cache_hits = 0
        self.cache_misses = 0

    # -- compile ---------------------------------------------------------------------------
    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        key = (spec.kind, spec.json_schema)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        schema = spec.json_schema if spec.kind == "json_schema" else _OBJECT_SCHEMA
        try:
            assert schema is not None
            compiled = self.compiler.compile_json_schema(
                schema, any_whitespace=False, strict_mode=spec.kind == "json_schema"
            )
        except Exception as err:  # xgrammar raises RuntimeError / its own errors on bad schemas
            raise GrammarError(
                f"The JSON schema cannot be used for constrained decoding: {_reason(err)}"
            ) from None
        self.compile_seconds.observe(time.perf_counter() - t0)
        with self._lock:
            self.cache_misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        return self._xgr.GrammarMatcher(self.compile(spec))

    # -- per step --------------------------------------------------------------------------
    def bitmask(self, matchers: list[xgr.GrammarMatcher | None]) -> torch.Tensor | None:
        """[rows, ceil(V/32)] int32 allowed-token bits for every row (all ones when a row is
        unconstrained), filled in one batched call; None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return None
        t0 = time.perf_counter()
        mask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], mask, rows)  # type: ignore[misc]
        self.mask_seconds.observe(time.perf_counter() - t0)
        return mask


def apply_bitmask_(logits: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> None:
    """Sets the logits of disallowed tokens to -inf, in place, for the whole batch at once."""
    import xgrammar as xgr

    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size)


_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+: ")


def _reason(err: BaseException) -> str:
    """xgrammar's message without its log prefix (a timestamp and a C++ source path)."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(err).strip().splitlines()]
    text = next((line for line in lines if line), type(err).__name__)
    return text if len(text) <= 300 else text[:297] + "..."
