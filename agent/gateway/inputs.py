"""What the gateway must know about a request before choosing where it goes.

The fields routing, accounting and the proxy act on are read here (model, stream,
stream_options, the shape of messages/prompt/input, max_tokens, n); then the whole body is
validated with the replica's own contract (`fleet_base.openai_contract`, via `contract.py`), so a
client sees the same 400 whichever of the two refused it. What only the loaded model can
judge (a schema its grammar compiler cannot express, the context window) is the replica's
4xx, passed through unchanged.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel
from starlette.requests import ClientDisconnect, Request

from agent.gateway.contract import check_body, embedding_prompts, responses_prompt_tokens
from agent.gateway.errors import GatewayError
from fleet_base.bounds import MAX_N, MAX_TOKENS, InputError, bounded_int, load_json
from fleet_base.openai_contract.continuation import RESUME_FIELD
from fleet_base.sampling_params import generation_limit

Endpoint = Literal["chat", "completions", "embeddings", "responses"]

# Without a max_tokens a request may run to the end of the context (its quota reservation
# covers that, `RequestInfo.worst_case_tokens`); for balancing load it counts this much.
DEFAULT_CHAT_MAX_TOKENS = 256
# Bodies above this are parsed and tokenized in a thread, off the gateway's event loop.
OFF_LOOP_BYTES = 64 * 1024
# Per-message overhead of a chat template (role markers, separators), in tokens.
CHAT_MESSAGE_OVERHEAD = 4


class TokenCounter(Protocol):
    """Counts the tokens of a text. The deployment's own tokenizer (`engine.tokenizer`,
    torch-free) goes here once the gateway knows each deployment's tokenizer files."""

    def count(self, text: str) -> int: ...


class CharEstimate:
    """About four characters per token: cheap, and good enough to balance load."""

    def count(self, text: str) -> int:
        return (len(text) + 3) // 4


@dataclass(frozen=True)
class RequestInfo:
    endpoint: Endpoint
    deployment: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    prompt_tokens: int  # estimated, over every prompt of the request
    max_tokens: int  # per sequence, as requested or the load estimate for an open-ended one
    sequences: int  # prompts x n
    prompt_ids: tuple[int, ...] | None = None  # the prompt's token ids, when tokenized (one prompt)
    max_tokens_given: bool = True  # False: the request may run to the end of the context
    prompts: int = 1  # separate prompts (a completions batch); sequences = prompts x n
    context_tokens: int | None = None  # the deployment's context window, once the gateway knows it
    raw: bytes = b""  # the body as the client sent it (forwarded to a peer as it is)
    contract: BaseModel | None = None  # the body as the replica's own model validated it
    tools: bool = False  # the request offers tools (a tool-call parser's state is not migrated)
    user: str | None = None  # the end user the client names (sticky canary side)
    resume_ids: tuple[int, ...] | None = None  # a peer gateway's continuation (RESUME_FIELD)

    @property
    def cost_tokens(self) -> int:
        """Tokens this request adds to a replica's outstanding work."""
        return self.prompt_tokens + self.max_tokens * self.sequences

    @property
    def migratable(self) -> bool:
        """Whether a stream of this request can be continued on another replica: streamed
        chat and completions of one sequence without tools (`agent.gateway.migration`)."""
        return (
            self.stream
            and self.endpoint in ("chat", "completions")
            and self.sequences == 1
            and not self.tools
        )

    def refuse_client_resume(self, forwarded: bool) -> None:
        """The continuation field is for gateways: a client's is a 400."""
        if self.resume_ids is not None and not forwarded:
            raise GatewayError(400, f"'{RESUME_FIELD}' is set by Fleet gateways only", param=RESUME_FIELD)

    def generated_tokens(self, context_tokens: int | None = None) -> int:
        """The most tokens the engine may generate for this request, over all its
        sequences: the engine's own rule (`generation_limit`) per prompt, times n. Without a
        context window known yet, an open-ended request counts its load estimate."""
        context = context_tokens if context_tokens is not None else self.context_tokens
        if self.max_tokens_given or context is None:
            return self.max_tokens * self.sequences
        per_prompt = self.prompt_tokens // max(1, self.prompts)  # the shorter prompts have more room
        return max(1, generation_limit(None, per_prompt, context)) * self.sequences

    def worst_case_tokens(self, context_tokens: int | None = None) -> int:
        """What the request may cost at most: its prompt and everything it may generate."""
        return self.prompt_tokens + self.generated_tokens(context_tokens)


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


def _optional_int(body: dict[str, Any], name: str, minimum: int, maximum: int = MAX_TOKENS) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    try:
        return bounded_int(value, name, minimum, maximum)
    except InputError as err:
        raise _bad(str(err), name) from None


def _chat_prompt_tokens(messages: Any, counter: TokenCounter) -> int:
    if not isinstance(messages, list):
        raise _bad("messages must be a list of message objects", "messages")
    if not messages:
        raise _bad("messages must not be empty", "messages")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        total += CHAT_MESSAGE_OVERHEAD
        content = message.get("content")
        if isinstance(content, str):
            total += counter.count(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += counter.count(part["text"])
    return total


def _completion_prompts(prompt: Any, counter: TokenCounter) -> tuple[int, int]:
    """(estimated tokens, number of prompts), with the engine's shape rules."""
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if prompt is None:
        raise _bad("prompt is required", "prompt")
    if isinstance(prompt, str):
        return counter.count(prompt), 1
    if not isinstance(prompt, list):
        raise _bad(shape, "prompt")
    if not prompt:
        raise _bad("prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return sum(counter.count(p) for p in prompt), len(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt), 1
    if all(isinstance(p, list) for p in prompt):
        for ids in prompt:
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise _bad("each token-id prompt must be a non-empty list of integers", "prompt")
        return sum(len(ids) for ids in prompt), len(prompt)
    raise _bad(shape, "prompt")


def parse_request(raw: bytes, endpoint: Endpoint, counter: TokenCounter | None = None) -> RequestInfo:
    """The routing-relevant facts of a request body, or a 400 saying what is wrong."""
    counter = counter or CharEstimate()
    try:
        body = load_json(raw)  # depth, lone surrogates, NaN: refused before any work
    except InputError as err:
        raise _bad(str(err)) from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise _bad("model is required: the name of a deployment (see GET /v1/models)", "model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("model must be a non-empty string naming a deployment", "model")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    wants_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise _bad("stream_options.include_usage must be a boolean", "stream_options")
        wants_usage = bool(include)
    n = _optional_int(body, "n", 1, MAX_N) or 1
    contract = check_body(raw, endpoint) if endpoint in ("embeddings", "responses") else None
    if endpoint == "embeddings":
        prompt_tokens, prompts = embedding_prompts(body, counter)
    elif endpoint == "responses":
        prompt_tokens, prompts = responses_prompt_tokens(body, counter), 1
    elif endpoint == "chat":
        prompt_tokens = _chat_prompt_tokens(body.get("messages"), counter)
        prompts = 1
        for name in ("max_tokens", "max_completion_tokens"):
            _optional_int(body, name, 1)
    else:
        prompt_tokens, prompts = _completion_prompts(body.get("prompt"), counter)
        _optional_int(body, "max_tokens", 1)
    if endpoint in ("chat", "completions"):
        contract = check_body(raw, endpoint)  # then everything else the replica checks, with its own 400s
    # the bound the engine will apply, read from the body as the replica's contract reads it
    requested: int | None = getattr(contract, "requested_max_tokens", 0)  # embeddings generate nothing
    max_tokens = requested if requested is not None else DEFAULT_CHAT_MAX_TOKENS
    return RequestInfo(
        endpoint=endpoint,
        deployment=model,
        body=body,
        stream=stream,
        client_wants_usage=stream and wants_usage,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        sequences=prompts * n,
        max_tokens_given=requested is not None,
        prompts=prompts,
        raw=raw,
        contract=contract,
        tools=bool(body.get("tools")),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        resume_ids=_resume_ids(body),
    )


def _resume_ids(body: dict[str, Any]) -> tuple[int, ...] | None:
    """The token ids a continuation resumes after; None: the body is no continuation."""
    if RESUME_FIELD not in body:
        return None
    resumed = body[RESUME_FIELD]
    return tuple(i for i in resumed if isinstance(i, int)) if isinstance(resumed, list) else ()


async def parse_off_loop(raw: bytes, endpoint: Endpoint) -> RequestInfo:
    """`parse_request`, in a thread for a large body (its JSON walk takes milliseconds)."""
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_request, raw, endpoint)
    return parse_request(raw, endpoint)


def upstream_body(info: RequestInfo, raw: bytes) -> bytes:
    """The body sent to a replica: a stream always asks for the final usage chunk (the
    gateway's accounting needs it; it is stripped again when the client did not ask)."""
    if not info.stream or info.client_wants_usage or info.endpoint == "responses":
        return raw  # a Responses stream always ends with its usage
    options = dict(info.body.get("stream_options") or {})
    options["include_usage"] = True
    return json.dumps({**info.body, "stream_options": options}, ensure_ascii=False).encode()


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with a 413 past `limit` bytes (declared or streamed)."""
    too_large = GatewayError(
        413,
        f"Request body is larger than this gateway's limit of {limit} bytes",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the listener's body deadline
        raise GatewayError(408, "The request body was not received in time", code="request_timeout") from None
    return b"".join(parts)
