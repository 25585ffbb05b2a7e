"""OpenAI response pieces: logprobs in chat and completions form, SSE framing."""

from __future__ import annotations

import json
import math
from typing import Any

from engine.outputs import CompletionOutput, SampleLogprobs, TokenLogprob
from engine.server.errors import APIError, engine_error, error_body, logger

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp like this


def _lp(x: float) -> float:
    return MIN_LOGPROB if math.isnan(x) or x < MIN_LOGPROB else float(x)


class TokenBytes:
    """Caches each token id's raw bytes (for the chat `bytes` field)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> list[int]:
        b = self.cache.get(token_id)
        if b is None:
            b = self.cache[token_id] = list(self.tokenizer.token_bytes([token_id])[0])
        return b


def chat_logprobs(steps: list[SampleLogprobs], token_bytes: TokenBytes) -> dict[str, Any]:
    def entry(t: TokenLogprob) -> dict[str, Any]:
        return {"token": t.token, "logprob": _lp(t.logprob), "bytes": token_bytes(t.token_id)}

    return {
        "content": [{**entry(s.sampled), "top_logprobs": [entry(t) for t in s.top]} for s in steps],
        "refusal": None,
    }


def completion_logprobs(steps: list[SampleLogprobs], start_offset: int = 0) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs; returns them and the text offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = start_offset
    for s in steps:
        tokens.append(s.sampled.token)
        token_logprobs.append(_lp(s.sampled.logprob))
        top.append({t.token: _lp(t.logprob) for t in s.top})
        offsets.append(offset)
        offset += len(s.sampled.token)
    lp = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return lp, offset


def visible_logprobs(out: CompletionOutput, steps: list[SampleLogprobs] | None) -> list[SampleLogprobs]:
    """Drops the entry of a final stop token (EOS, stop_token_ids): its text is not in the output,
    so the remaining tokens concatenate to the content."""
    steps = list(steps or [])
    if steps and out.finish_reason == "stop" and not isinstance(out.stop_reason, str):
        last = out.delta_token_ids or out.token_ids  # the stop token is the last one generated
        if last and steps[-1].sampled.token_id == last[-1]:
            steps.pop()
    return steps


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(err: BaseException) -> str:
    """An error after the stream started; OpenAI clients raise it from the `error` field."""
    api = engine_error(err)
    if api is None:
        logger.error("error while streaming a response: %r", err)
        api = APIError(500, f"Internal server error: {type(err).__name__}")
    elif api.status >= 500 and api.code != "replica_draining":
        logger.warning("stream ended with %s: %s", api.code or api.status, api.message)
    else:  # a hand-over or a client-side cause: expected, not a fault of this server
        logger.info("stream ended with %s: %s", api.code or api.status, api.message)
    return sse(error_body(api.status, api.message, api.param, api.code))
