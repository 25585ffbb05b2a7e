"""`python -m agent.sim.server`: a simulated replica. It speaks the engine's OpenAI API
(chat/completions, completions, SSE with usage, unstreamed responses, /v1/models, /health,
/metrics with the engine's metric names) but runs no model: its timing follows a `PerfProfile` through a
`ReplicaModel` in real time, its text is a placeholder, and every response says
`system_fingerprint: "simulated"`.

- /health answers 503 `{"status": "loading"}` for `cold_start_s` after start, then 200;
  on SIGTERM it answers 503 `draining`, refuses new work and exits once in-flight requests
  finish (bounded by --drain-timeout), like the engine.
- prompt tokens are estimated from the text (4 characters a token); output length is
  `max_tokens` (default 16): a simulated model never stops early.
- `--error-rate X` fails that share of requests with a 500 (a "bad version" for canaries).
- `--text-diverge-at K` (a test device for shadow traffic): output tokens from index K on
  are other words with other token ids, so a version with the flag answers a greedy request
  differently from one without it, deterministically, from token K. Without it (any --seed)
  every replica's text is the same.
- token ids: token i of the text has id `i % 10` (diverged: `10 + i % 10`). A request with
  the continuation header gets them on each streamed chunk (and on an unstreamed choice),
  and a continuation (`fleet_resume_token_ids`) goes on from the tokens it already has, as
  the engine's (fleet_base/openai_contract/continuation.py).
- an unstreamed answer says its time from arrival to first token (model clock) in the
  `x-fleet-ttft-s` header, as the engine's does (fleet_base/openai_contract/timing.py).
- with FLEET_ENGINE_TEST_HOOKS=1, as the engine: POST /debug/corrupt makes every answer
  wrong (diverged from its first token, ids and text) until POST /debug/uncorrupt, while
  /health stays 200 (the fault the agent's correctness probe catches).
- `--cut-stream-at K` (a test device for stream migration): a stream's connection ends,
  unfinished, once it has sent output token K; a continuation that starts at or past K
  runs to the end (so two replica entries of one sim migrate a stream exactly once).
- with the standard OTEL_* env it continues each request's W3C trace in a `sim.request`
  span (`fleet_base.tracing`), as the engine does.
- flags of the real engine it does not know (e.g. --threads) are accepted and ignored, so
  a host's `replica.extra_args` serve both runtimes.

Over ~400 lines: the engine's OpenAI surface (shapes, SSE, /metrics names) mirrored in one
place, so the simulated replica cannot drift from the real one piecemeal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from agent.security.replica_auth import API_KEY_ENV, CERT_ENV, KEY_ENV, require_bearer
from agent.sim.model import ReplicaModel, SimRequest
from fleet_base import heap_trim, tracing
from fleet_base.bounds import Seed
from fleet_base.listener import uvicorn_options

# The engine's own buckets, so dashboards read both runtimes alike.
from fleet_base.metric_buckets import PROMPT_TOKEN_BUCKETS, QUEUE_BUCKETS, TTFT_BUCKETS
from fleet_base.openai_contract.continuation import RESUME_FIELD, TOKEN_IDS_FIELD, TOKEN_IDS_HEADER
from fleet_base.openai_contract.responses import ResponsesRequest
from fleet_base.openai_contract.timing import TTFT_HEADER, ttft_header
from fleet_base.profile import PerfProfile, load_profile

log = logging.getLogger("agent.sim.server")

FINGERPRINT = "simulated"
DEFAULT_PROFILE = "llama2-70b-h100-tp4"
DEFAULT_MAX_TOKENS = 16
WORDS = ("sim", "ulated", " text", " from", " a", " replica", " without", " a", " model", ".")
# a diverged token's words (--text-diverge-at): each differs from WORDS' from its first character
DIVERGED = ("SIM", "ULATED", "_text", "_from", "_a", "_replica", "_without", "_a", "_model", "!")
MAX_BODY = 4 * 1024 * 1024
# As engine/server/launcher.py's: test hooks (POST /debug/corrupt, /debug/uncorrupt)
TEST_HOOKS_ENV = "FLEET_ENGINE_TEST_HOOKS"
EXIT_GRACE_S = 1.0  # after draining, for connections to close before the process exits anyway


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[Any] | None = None
    seed: Seed | None = None  # the engine's bound: a simulated replica refuses what a real one does
    resume: list[int] | None = Field(None, alias=RESUME_FIELD, max_length=1_000_000)


def estimate_tokens(body: _Body) -> int:
    """Prompt tokens, estimated: 4 characters a token (a list of ids counts as such)."""
    if body.messages is not None:
        chars = sum(len(json.dumps(m.get("content", ""))) + 4 for m in body.messages)
        return max(1, chars // 4)
    prompt = body.prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return len(prompt)
        return max(1, sum(len(str(x)) for x in prompt) // 4)
    return max(1, len(prompt or "") // 4)


def placeholder(start: int, end: int, diverge_at: int | None = None) -> str:
    """Text of output tokens [start, end); from `diverge_at` on, the diverged words."""
    return "".join(
        (DIVERGED if diverge_at is not None and i >= diverge_at else WORDS)[i % len(WORDS)]
        for i in range(start, end)
    )


def token_ids(start: int, end: int, diverge_at: int | None = None) -> list[int]:
    """Ids of output tokens [start, end), as `placeholder` renders them."""
    return [
        (len(WORDS) if diverge_at is not None and i >= diverge_at else 0) + i % len(WORDS)
        for i in range(start, end)
    ]


@dataclass
class SimState:
    profile: PerfProfile
    served_model_name: str
    cold_start_s: float
    error_rate: float
    seed: int = 0
    diverge_at: int | None = None  # --text-diverge-at
    cut_at: int | None = None  # --cut-stream-at
    test_hooks: bool = False  # FLEET_ENGINE_TEST_HOOKS=1
    corrupt: bool = False  # POST /debug/corrupt: every answer diverges from its first token
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    first_ttft: float | None = None

    def __post_init__(self) -> None:
        self.model = ReplicaModel(self.profile, now=0.0)
        self.rng = random.Random(self.seed)
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram(
            "fleet_engine_time_to_first_token_seconds", "Simulated arrival to first token.",
            ["model"], registry=self.registry, buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.prompt_len = Histogram(
            "fleet_engine_request_prompt_tokens", "Prompt tokens of each request, with its TTFT.",
            ["model"], registry=self.registry, buckets=PROMPT_TOKEN_BUCKETS,
        )  # fmt: skip
        self.queue_time = Histogram(
            "fleet_engine_request_queue_time_seconds", "Simulated arrival to first scheduled.",
            ["model"], registry=self.registry, buckets=QUEUE_BUCKETS,
        )  # fmt: skip
        self.changed = asyncio.Event()  # a new request arrived: the driver re-plans
        self.progress = asyncio.Condition()  # tokens came out: streams look
        self._next_id = 0

    def now(self) -> float:
        return time.monotonic() - self.started

    @property
    def ready(self) -> bool:
        return self.now() >= self.cold_start_s

    def new_request(self, prompt_tokens: int, output_tokens: int) -> SimRequest:
        self._next_id += 1
        return SimRequest(self._next_id, prompt_tokens, output_tokens, arrival=self.now())


async def drive(state: SimState) -> None:
    """Advances the model in real time: sleeps until its next event (at most 50 ms, so
    streams see steady progress) or until a request arrives."""
    while True:
        state.model.advance(state.now())
        async with state.progress:
            state.progress.notify_all()
        wait = min(state.model.next_event_time() - state.now(), 0.05 if not state.model.idle() else 1.0)
        state.changed.clear()
        if wait > 0:
            try:
                await asyncio.wait_for(state.changed.wait(), timeout=wait)
            except TimeoutError:
                pass


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": kind.get(status, "internal_error"),
                "param": param,
                "code": None,
            }
        },
        status_code=status,
    )


def build_app(state: SimState) -> Starlette:
    async def health(request: Request) -> Response:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading", "error": ""}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.served_model_name, "simulated": True})

    async def metrics(request: Request) -> Response:
        m, name = state.model, state.served_model_name
        lab = f'{{model="{name}"}}'
        lines = [
            "# TYPE fleet_engine_requests_running gauge",
            f"fleet_engine_requests_running{lab} {m.num_running}",
            "# TYPE fleet_engine_requests_waiting gauge",
            f"fleet_engine_requests_waiting{lab} {m.num_waiting}",
            "# TYPE fleet_engine_kv_cache_usage_ratio gauge",
            f"fleet_engine_kv_cache_usage_ratio{lab} {m.kv_usage}",
            "# TYPE fleet_engine_prompt_tokens counter",
            f"fleet_engine_prompt_tokens_total{lab} {m.prompt_tokens}",
            "# TYPE fleet_engine_generation_tokens counter",
            f"fleet_engine_generation_tokens_total{lab} {m.tokens_generated()}",
            "# TYPE fleet_engine_requests counter",
            f'fleet_engine_requests_total{{model="{name}",status="ok"}} {state.requests_ok}',
            f'fleet_engine_requests_total{{model="{name}",status="error"}} {state.requests_failed}',
            "# TYPE fleet_sim_time_to_first_token_seconds summary",
            f"fleet_sim_time_to_first_token_seconds_sum{lab} {state.ttft_sum}",
            f"fleet_sim_time_to_first_token_seconds_count{lab} {state.ttft_count}",
        ]
        if state.ready:  # the engine's cold-start parts: the simulated load, no warm-up
            lines.append("# TYPE fleet_engine_startup_seconds gauge")
            phases = {"load": state.cold_start_s, "warmup": 0.0, "first_token": state.first_ttft}
            lines += [f'fleet_engine_startup_seconds{{model="{name}",phase="{p}"}} {v}'
                      for p, v in phases.items() if v is not None]  # fmt: skip
        histograms = generate_latest(state.registry).decode()
        return PlainTextResponse("\n".join(lines) + "\n" + histograms, media_type="text/plain; version=0.0.4")

    async def models(request: Request) -> Response:
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "fleet",
        }
        return JSONResponse({"object": "list", "data": [{**card, "simulated": True}]})

    async def chat(request: Request) -> Response:
        return await _generate(request, state, chat=True)

    async def completions(request: Request) -> Response:
        return await _generate(request, state, chat=False)

    async def responses(request: Request) -> Response:
        return await _responses(request, state)

    async def corrupt(request: Request) -> Response:
        state.corrupt = request.url.path.endswith("/corrupt")
        return JSONResponse({"corrupt": state.corrupt})

    hooks = [Route(p, corrupt, methods=["POST"]) for p in ("/debug/corrupt", "/debug/uncorrupt")]
    return Starlette(
        routes=[
            *(hooks if state.test_hooks else []),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
        ]
    )


def _parse(raw: bytes, state: SimState, *, chat: bool) -> _Body | Response:
    """The request body, or the error response an engine would give for it."""
    if len(raw) > MAX_BODY:
        return _error(413, "request body too large")
    try:
        body = _Body.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        return _error(400, f"{param}: {first['msg']}", param)
    if body.model is not None and body.model != state.served_model_name:
        return _error(
            404,
            f"The model '{body.model}' does not exist on this server; it serves '{state.served_model_name}'",
            "model",
        )
    if chat and not body.messages:
        return _error(400, "messages: a non-empty list is required", "messages")
    if not chat and body.prompt is None:
        return _error(400, "prompt: required", "prompt")
    return body


async def _finished(state: SimState, req: SimRequest) -> None:
    """Wait for an unstreamed request's last token; a client that went away meanwhile takes
    it out of the in-flight count (a drain does not wait for it)."""
    try:
        async with state.progress:
            await state.progress.wait_for(lambda: req.finished_at is not None)
    except asyncio.CancelledError:
        state.in_flight -= 1
        raise


def _record_done(state: SimState, req: Any) -> None:
    """A finished request in the counters and the TTFT / queue-time histograms."""
    state.in_flight -= 1
    state.requests_ok += 1
    if req.first_token_at is not None:
        state.ttft_sum += req.first_token_at - req.arrival
        state.ttft_count += 1
        if state.first_ttft is None:
            state.first_ttft = req.first_token_at - req.arrival
        state.ttft.labels(state.served_model_name).observe(req.first_token_at - req.arrival)
        state.prompt_len.labels(state.served_model_name).observe(req.prompt_tokens)
    if req.admitted_at is not None:
        state.queue_time.labels(state.served_model_name).observe(req.admitted_at - req.arrival)


async def _generate(request: Request, state: SimState, *, chat: bool) -> Response:
    want_ids = request.headers.get(TOKEN_IDS_HEADER, "") in ("1", "true")
    span = tracing.start_span(
        "sim.request",
        headers=request.headers,
        kind=tracing.SERVER,
        attributes={tracing.MODEL: state.served_model_name},
    )
    try:
        response = await _generate_parsed(
            await request.body(), state, chat=chat, want_ids=want_ids, span=span
        )
    except BaseException as err:
        tracing.fail(span, type(err).__name__)
        span.end()
        raise
    tracing.set_attributes(span, {tracing.STATUS: response.status_code})
    if not isinstance(response, StreamingResponse):  # a stream's span ends with the stream
        span.end()
    return response


async def _responses(request: Request, state: SimState) -> Response:
    """/v1/responses, unstreamed: translated onto chat as the engine translates it, the
    chat result re-shaped into a Response object (its usage in input/output tokens)."""
    raw = await request.body()
    if len(raw) > MAX_BODY:
        return _error(413, "request body too large")
    try:
        req = ResponsesRequest.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors()[0]
        return _error(400, f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}")
    if req.stream:
        return _error(400, "stream: a simulated replica answers /v1/responses unstreamed only", "stream")
    chat = await _generate_parsed(json.dumps(req.chat_body()).encode(), state, chat=True)
    if chat.status_code != 200:
        return chat
    result = json.loads(bytes(chat.body))
    usage = result["usage"]
    text = result["choices"][0]["message"]["content"]
    return JSONResponse({
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": result["created"],
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},  # never stops early
        "model": state.served_model_name,
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "incomplete",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"]},
    }, headers={k: v for k, v in chat.headers.items() if k == TTFT_HEADER})  # fmt: skip


async def _generate_parsed(
    raw: bytes,
    state: SimState,
    *,
    chat: bool,
    want_ids: bool = False,
    span: tracing.Span = tracing.INVALID_SPAN,
) -> Response:
    if state.draining:
        return _error(503, "The server is shutting down")
    if not state.ready:
        return _error(503, "The model is still loading; retry shortly")
    body = _parse(raw, state, chat=chat)
    if isinstance(body, Response):
        return body
    return await _run(body, state, chat=chat, want_ids=want_ids, span=span)


async def _run(
    body: _Body,
    state: SimState,
    *,
    chat: bool,
    want_ids: bool = False,
    span: tracing.Span = tracing.INVALID_SPAN,
) -> Response:
    if state.error_rate > 0 and state.rng.random() < state.error_rate:
        state.requests_failed += 1
        return _error(500, "simulated failure (error_rate)")

    out_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    # a continuation: its resumed tokens are output already (prefilled, not generated again)
    skip = min(len(body.resume or ()), out_tokens - 1)
    req = state.new_request(estimate_tokens(body) + skip, out_tokens - skip)
    state.model.submit(req, state.now())
    state.in_flight += 1
    state.changed.set()
    prefix = "chatcmpl" if chat else "cmpl"
    head = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.served_model_name,
        "system_fingerprint": FINGERPRINT,
    }
    usage = {
        "prompt_tokens": req.prompt_tokens - skip,
        "completion_tokens": out_tokens,
        "total_tokens": req.prompt_tokens - skip + out_tokens,
    }
    diverge = 0 if state.corrupt else state.diverge_at
    tracing.set_attributes(
        span,
        {
            tracing.PROMPT_TOKENS: usage["prompt_tokens"],
            tracing.COMPLETION_TOKENS: out_tokens,
            "fleet.resumed_tokens": skip or None,
            "fleet.stream": body.stream,
        },
    )

    def done() -> None:
        _record_done(state, req)

    if not body.stream:
        await _finished(state, req)
        done()
        text = placeholder(skip, out_tokens, diverge)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        if want_ids:
            choice[TOKEN_IDS_FIELD] = token_ids(skip, out_tokens, diverge)
        first = req.first_token_at
        timing = ttft_header(None if first is None else first - req.arrival)
        return JSONResponse({**head, "object": obj, "choices": [choice], "usage": usage}, headers=timing)

    include_usage = bool((body.stream_options or {}).get("include_usage"))
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(start: int, end: int, finish: str | None, first: bool) -> str:
        delta = placeholder(skip + start, skip + end, diverge)
        if chat:
            d: dict[str, Any] = {"content": delta}
            if first:
                d = {"role": "assistant", "content": delta}
            c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        if want_ids:
            c[TOKEN_IDS_FIELD] = token_ids(skip + start, skip + end, diverge)
        payload: dict[str, Any] = {**head, "object": obj, "choices": [c]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n"

    async def events() -> AsyncIterator[str]:
        sent = 0
        try:
            while sent < req.output_tokens:
                async with state.progress:
                    await state.progress.wait_for(lambda n=sent: state.model.tokens_out(req) > n)
                now_out = state.model.tokens_out(req)
                finish = "length" if now_out >= req.output_tokens else None
                yield chunk(sent, now_out, finish, sent == 0)
                sent = now_out
                if finish is None and state.cut_at is not None and skip < state.cut_at <= skip + sent:
                    tracing.fail(span, "cut")  # --cut-stream-at: the connection ends unfinished
                    return
            if include_usage:
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            done()
            span.end()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent.sim.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, help="profile name (fleet_base/profiles) or JSON path"
    )
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--model", default="", help="ignored (what a real engine would load)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--cold-start", type=float, default=None, help="seconds before ready (default: the profile's)"
    )
    p.add_argument("--error-rate", type=float, default=None, help="share of requests failed with 500")
    p.add_argument("--max-num-seqs", type=int, default=None, help="override the profile's batch limit")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="override the profile's long-prefill cap (the engine's flag; 0 = off)",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text-diverge-at",
        type=int,
        default=None,
        help="a test device: output tokens from this index on are other words and ids",
    )
    p.add_argument(
        "--cut-stream-at",
        type=int,
        default=None,
        help="a test device: a stream ends, unfinished, once it has sent output token K (a continuation does not)",
    )
    # As the engine: the replica token and HTTPS certificate from the environment.
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, "").strip() or None)
    p.add_argument("--ssl-certfile", default=os.environ.get(CERT_ENV))
    p.add_argument("--ssl-keyfile", default=os.environ.get(KEY_ENV))
    return p


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        log.info("ignoring engine flags a simulated replica does not use: %s", " ".join(unknown))
    try:
        profile = load_profile(args.profile)
    except ValueError as err:
        sys.exit(f"error: {err}")
    updates: dict[str, Any] = {}
    if args.max_num_seqs is not None:
        updates["max_num_seqs"] = args.max_num_seqs
    if args.long_prefill_token_threshold is not None:
        updates["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    try:
        profile = PerfProfile.model_validate({**profile.model_dump(), **updates})
    except ValidationError as err:
        sys.exit(f"error: profile {profile.name}: {err.errors()[0]['msg']}")
    error_rate = profile.error_rate if args.error_rate is None else args.error_rate
    if not 0 <= error_rate <= 1:
        sys.exit("error: --error-rate must be within 0..1")
    cold = profile.cold_start_s if args.cold_start is None else max(0.0, args.cold_start)
    log.info(
        "simulated replica %s: profile %s, cold start %.1f s, error rate %.3f",
        args.served_model_name,
        profile.name,
        cold,
        error_rate,
    )
    try:
        heap_trim.start()  # before any thread (the span exporter's) takes an arena of its own
    except ValueError as err:
        sys.exit(f"error: {err}")
    tracing.setup("fleet-sim", attributes={tracing.DEPLOYMENT: args.served_model_name})
    asyncio.run(_serve(args, profile, cold, error_rate))


async def _serve(args: argparse.Namespace, profile: PerfProfile, cold: float, error_rate: float) -> None:
    diverge = None if args.text_diverge_at is None else max(0, args.text_diverge_at)
    state = SimState(profile, args.served_model_name, cold, error_rate, seed=args.seed, diverge_at=diverge)
    state.cut_at = None if args.cut_stream_at is None else max(1, args.cut_stream_at)
    state.test_hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    server = uvicorn.Server(
        uvicorn.Config(
            require_bearer(build_app(state), args.api_key),
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            **uvicorn_options(behind_pool=True),  # the gateway's pool closes idle connections first
        )
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    driver = asyncio.create_task(drive(state))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve())

    async def on_stop() -> None:
        await stop.wait()
        state.draining = True
        log.info("draining: %d requests in flight", state.in_flight)
        deadline = time.monotonic() + args.drain_timeout
        while state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True
        # nothing in flight: idle keep-alive TLS connections would hold the exit for asyncio's
        # 30 s TLS shutdown timeout while their peers (gateways' pools) keep them open
        await asyncio.sleep(EXIT_GRACE_S)
        server.force_exit = True

    stopper = asyncio.create_task(on_stop())
    await serving
    stopper.cancel()
    driver.cancel()


if __name__ == "__main__":
    main()
