"""A request's sequences on the text side, and the outputs built from them.

A request with `n > 1` is a parent of n sequences. While it streams, each output carries
only what is new since the last one (a slow reader's queue then holds each token once,
not the whole text again on every step); the cumulative text, ids and logprobs come only
on the final output, which non-streamed callers read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs
from engine.request import Request
from engine.tokenizer import IncrementalDetokenizer
from fleet_base.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceState:
    """Text-side state of one sequence: detokenizer, stop handling, what was streamed."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    stop_ids: set[int]
    text: str = ""
    emitted_chars: int = 0
    emitted_tokens: int = 0
    logprobs: list[SampleLogprobs] | None = None
    emitted_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.request.status.finished


@dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    arrival_time: float
    seqs: list[SequenceState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def make_output(parent: ParentRequest) -> RequestOutput:
    """What is new for each sequence since the last output; the cumulative fields only
    on the final one (a streamed request's outputs queue up when its reader is slow)."""
    full = parent.finished
    completions = []
    for seq in parent.seqs:
        req = seq.request
        p = req.sampling_params
        # While streaming, hold back a tail that could still become a stop string.
        hold = 0 if req.status.finished or not p.stop else p.max_stop_len - 1
        end = max(seq.emitted_chars, len(seq.text) - hold)
        tokens = req.output_token_ids
        lps = seq.logprobs
        completions.append(
            CompletionOutput(
                index=seq.index,
                text=seq.text[:end] if full else "",
                token_ids=list(tokens) if full else [],
                logprobs=list(lps) if full and lps is not None else None,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
                delta_text=seq.text[seq.emitted_chars : end],
                delta_token_ids=tokens[seq.emitted_tokens :],
                delta_logprobs=lps[seq.emitted_logprobs :] if lps is not None else None,
            )
        )
        seq.emitted_chars = end
        seq.emitted_tokens = len(tokens)
        if lps is not None:
            seq.emitted_logprobs = len(lps)
    first = parent.seqs[0].request
    metrics = RequestMetrics(
        arrival_time=parent.arrival_time,
        first_scheduled_time=min(
            (q.request.first_scheduled_time for q in parent.seqs if q.request.first_scheduled_time),
            default=None,
        ),
        first_token_time=min(
            (q.request.first_token_time for q in parent.seqs if q.request.first_token_time), default=None
        ),
        last_token_time=max(
            (q.request.last_token_time for q in parent.seqs if q.request.last_token_time), default=None
        ),
        finished_time=time.monotonic() if parent.finished else None,
    )
    return RequestOutput(
        request_id=parent.request_id,
        prompt=parent.prompt,
        prompt_token_ids=parent.prompt_token_ids,
        outputs=completions,
        finished=parent.finished,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        metrics=metrics,
        num_preemptions=sum(q.request.num_preemptions for q in parent.seqs),
        embedding=first.embedding,
    )
