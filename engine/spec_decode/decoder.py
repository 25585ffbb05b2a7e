"""The engine's side of speculative decoding: drafts before a step, rollback after it.

Before scheduling, every running sequence that is decoding gets up to k n-gram drafts in
`Request.spec_token_ids` (never past max_tokens or the context window). The scheduler runs
them with the sequence's next token as one chunk; the runner verifies them all in the step's
single forward pass (`engine.spec_decode.acceptance`). Afterwards the KV of rejected drafts
is given back: the computed count drops to the accepted tokens and blocks that held only
rejected slots return to the pool (they were never full of real tokens, so never cached).

Drafting is gated (`engine.spec_decode.gate`): no sequence is drafted in a step where
`disable_by_batch_size` or more sequences decode, and a sequence whose drafts keep being
rejected backs off for a growing number of steps.

Structured-output (grammar) sequences are not drafted: their masks depend on every earlier
token. Logprobs, penalties, min_tokens, stop strings and tokens, seeds, LoRA and
continuations all work unchanged, because every kept token is an ordinary sampled row.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.gate import Backoff, drafts_this_step
from engine.spec_decode.ngram import NgramIndex


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # Each sequence's n-gram index lives as long as its Request (preemption keeps it).
        self._index: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()
        self._backoff: weakref.WeakKeyDictionary[Request, Backoff] = weakref.WeakKeyDictionary()
        self.num_drafts = 0  # verification chunks run
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # of those, accepted
        self.num_gated_steps = 0  # steps with decoding sequences where the batch-size gate said no
        self.num_backoff_skips = 0  # sequence-steps not drafted because of backoff

    @staticmethod
    def eligible(req: Request) -> bool:
        return req.grammar is None and not req.pooling

    def max_drafts(self, req: Request) -> int:
        """Drafts that still fit: all of them plus one more token within max_tokens and the window."""
        p = req.sampling_params
        left = (p.max_tokens if p.max_tokens is not None else self.max_model_len) - req.num_output_tokens
        room = self.max_model_len - req.num_tokens
        return min(self.config.num_speculative_tokens, left - 1, room - 1)

    def propose(self, running: Iterable[Request]) -> None:
        """Set each decoding sequence's drafts for the coming step."""
        cfg = self.config
        decoding: list[Request] = []  # every sequence this step decodes counts towards the gate
        for req in running:
            if req.spec_token_ids:
                req.spec_token_ids = []
            if req.num_computed_tokens == req.num_tokens - 1 and not req.pooling:
                decoding.append(req)
        if not decoding:
            return
        if not drafts_this_step(len(decoding), cfg.disable_by_batch_size):
            self.num_gated_steps += 1
            return
        for req in decoding:
            k = self.max_drafts(req) if self.eligible(req) else 0
            if k <= 0:
                continue
            backoff = self._backoff.get(req)
            if backoff is not None and not backoff.should_draft():
                self.num_backoff_skips += 1
                continue
            index = self._index.get(req)
            if index is None:
                index = self._index[req] = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            index.append(req.token_ids_slice(len(index), req.num_tokens))
            req.spec_token_ids = index.propose(k)

    def after_verify(self, req: Request, num_drafts: int, accepted: int, kv: KVCacheManager) -> None:
        """Count one verified chunk; roll a still-running sequence back to its real tokens."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self._backoff.setdefault(req, Backoff()).observe(accepted)
        req.spec_token_ids = []
        if req.is_finished:  # its blocks are already freed
            return
        req.num_computed_tokens = req.num_tokens - 1  # the last token's KV comes next step
        kv.trim(req, req.num_tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
