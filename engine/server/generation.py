"""Runs one API request on the engine: submits its prompts, merges their output streams,
observes metrics, and aborts whatever is still running when the client goes away.

Admission errors (context overflow, full queue) surface from `start()` before any response
byte is sent, so even streaming requests get a proper 4xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from engine.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from engine.server.errors import APIError, context_error, engine_error
from engine.server.request_spans import REQUEST_ID_HEADER, RequestSpans
from engine.server.state import EngineClient, ServerState
from fleet_base import tracing
from fleet_base.openai_contract.priority import DEFAULT_PRIORITY, PRIORITY_CLASS_HEADER, engine_priority
from fleet_base.openai_contract.requests import ChatCompletionRequest, CompletionRequest
from fleet_base.openai_contract.timing import ttft_header
from fleet_base.sampling_params import SamplingParams

_background: set[asyncio.Task[Any]] = set()


class HandedOver(APIError):
    """A draining replica ended this stream so the gateway continues it elsewhere."""

    def __init__(self) -> None:
        super().__init__(
            503, "This replica is draining; the stream continues on another one", code="replica_draining"
        )


def spawn(coro: Coroutine[Any, Any, Any]) -> None:
    """Runs `coro` to completion even if the caller is being cancelled right now."""
    task = asyncio.get_running_loop().create_task(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def check_context(engine: EngineClient, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
    """Refuses a request whose prompt plus completion cannot fit the context window."""
    limit = engine.max_model_len
    if num_prompt_tokens + (max_tokens if max_tokens is not None else 1) > limit:
        raise context_error(limit, num_prompt_tokens, max_tokens, param)


@dataclass
class ChoiceState:
    """One output sequence (choice): its latest output (a request's final one carries the
    whole text, token ids and logprobs) and, when the stream forwards them, the token ids
    generated since the last chunk that carried ids."""

    latest: CompletionOutput
    finish_sent: bool = False
    unsent_ids: list[int] = field(default_factory=list)

    def all_logprobs(self) -> list[SampleLogprobs]:
        return self.latest.logprobs or []

    def take_ids(self) -> list[int]:
        ids, self.unsent_ids = self.unsent_ids, []
        return ids


class Generation:
    """One API request's engine requests (one per prompt; `params.n` sequences each)."""

    def __init__(
        self,
        state: ServerState,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        param: str,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ) -> None:
        assert state.engine is not None
        self.state = state
        self.engine = state.engine
        self.prompts = prompts
        self.params = params
        self.param = param
        self.request_id = request_id
        self.cache_salt = cache_salt
        # a continuation (engine.continuation): these tokens were generated and streamed already
        self.resume_token_ids = resume_token_ids or None
        if self.resume_token_ids is not None and len(prompts) != 1:
            raise APIError(400, "a continuation (fleet_resume_token_ids) has exactly one prompt")
        self.lora_name = lora_name
        if lora_name is not None:
            state.metrics.lora_request(lora_name)
        self.ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.final: list[RequestOutput | None] = [None] * len(prompts)
        self.choices: dict[tuple[int, int], ChoiceState] = {}
        self._iters: list[AsyncIterator[RequestOutput] | None] = [None] * len(prompts)
        self._firsts: list[RequestOutput] = []
        self._done = [False] * len(prompts)
        self._observers = [state.metrics.observer() for _ in prompts]
        self._spans: list[RequestSpans] | None = None  # only while tracing is on (`trace`)
        self._watcher: asyncio.Task[None] | None = None
        self.handed_over = False
        self.keep_token_ids = False  # the stream forwards each chunk's token ids (continuation)
        self.priority = DEFAULT_PRIORITY  # the scheduler's, from the gateway's class (`run`)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Submits every prompt and waits for each one's first output (or admission error)."""
        self.state.active_requests.update(self.ids)
        results = await asyncio.gather(
            *(self._first(i) for i in range(len(self.prompts))), return_exceptions=True
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            if self._spans is not None:
                for spans, r in zip(self._spans, results):
                    if isinstance(r, BaseException):
                        spans.fail(r)
            self.close(count_aborts=False)
            mapped = engine_error(failure, self.param, self.state.settings.retry_after_s)
            if mapped is None:
                raise failure
            raise mapped
        self._firsts = [r for r in results if isinstance(r, RequestOutput)]

    async def _first(self, i: int) -> RequestOutput:
        extra = {"resume_token_ids": self.resume_token_ids} if self.resume_token_ids else {}
        if self.lora_name is not None:
            extra["lora_name"] = self.lora_name
        it = self.engine.generate(
            self.prompts[i],
            self.params,
            self.ids[i],
            priority=self.priority,
            cache_salt=self.cache_salt,
            **extra,
        )
        self._iters[i] = it
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"engine stream {self.ids[i]} ended before any output") from None

    async def run(self, request: Request, stream: bool) -> None:
        """Submit every prompt; for a plain response also wait for the end and release.

        A client that disconnects meanwhile aborts the work (the watch ends here; a stream
        notices a disconnect through its own body)."""
        self.priority = engine_priority(request.headers.get(PRIORITY_CLASS_HEADER))
        self.trace(request)
        self.watch_disconnect(request)
        try:
            await self.start()
            if not stream:
                await self.collect()
        finally:
            self.stop_watching()
            if not stream:
                self.close()

    def trace(self, request: Request) -> None:
        """With tracing on, one span set per engine request, under the caller's trace context."""
        if not tracing.enabled():
            return
        parent = tracing.extract(request.headers)
        model = self.lora_name or self.state.settings.served_model_name
        caller_id = request.headers.get(REQUEST_ID_HEADER)
        resumed = len(self.resume_token_ids or ())
        self._spans = [
            RequestSpans(
                parent,
                model=model,
                engine_request_id=rid,
                num_prompt_tokens=len(p),
                request_id=caller_id,
                resumed_tokens=resumed,
            )
            for rid, p in zip(self.ids, self.prompts)
        ]

    def watch_disconnect(self, request: Request) -> None:
        """Aborts the engine requests as soon as the client disconnects (non-streaming path)."""

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.close()
                    return

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def hand_over(self) -> bool:
        """End the stream with `HandedOver` (its next output raises it) and free the engine.
        A stream whose every request already finished has nothing left to hand over (False)."""
        self.handed_over = not all(self._done)
        self.close()
        return self.handed_over

    def allow_hand_over(self) -> None:
        """A gateway that can continue this stream elsewhere asked for its token ids."""
        self.state.handovers[self.request_id] = self.hand_over

    def close(self, count_aborts: bool = True) -> None:
        """Aborts every engine request that has not finished; safe to call more than once."""
        self.state.handovers.pop(self.request_id, None)
        self.stop_watching()
        for i, rid in enumerate(self.ids):
            if not self._done[i]:
                self._done[i] = True
                if count_aborts:
                    self._observers[i].abandon(self.params.n)
                if self._spans is not None:
                    self._spans[i].abandon(self.handed_over)
                if self._iters[i] is not None:
                    spawn(self.engine.abort(rid))
            self.state.active_requests.discard(rid)

    # -- outputs ---------------------------------------------------------------------------
    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order until every prompt's request finished."""
        try:
            for i, first in enumerate(self._firsts):
                self._record(i, first)
                yield i, first
            pending = [i for i in range(len(self.prompts)) if not self._done[i]]
            if len(pending) == 1:
                i = pending[0]
                it = self._iters[i]
                assert it is not None
                async for out in it:
                    if self.handed_over:
                        raise HandedOver()
                    self._record(i, out)
                    yield i, out
                    if self._done[i]:
                        break
            elif pending:
                async for i, out in self._merged(pending):
                    if self.handed_over:
                        raise HandedOver()
                    self._record(i, out)
                    yield i, out
            # The hand-over may come while this generator waits at a `yield` (the server is
            # writing a chunk): it marks every request done, so the loops above end quietly.
            if self.handed_over:
                raise HandedOver()
        finally:
            self.close()

    async def _merged(self, pending: list[int]) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            it = self._iters[i]
            assert it is not None
            try:
                async for out in it:
                    await queue.put((i, out))
                    if out.finished:
                        break
            finally:
                await queue.put((i, None))

        tasks = [asyncio.get_running_loop().create_task(pump(i)) for i in pending]
        try:
            remaining = len(tasks)
            while remaining:
                i, out = await queue.get()
                if out is None:
                    remaining -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    def _record(self, i: int, out: RequestOutput) -> None:
        self.final[i] = out
        for o in out.outputs:
            key = (i, o.index)
            st = self.choices.get(key)
            if st is None:
                self.choices[key] = st = ChoiceState(latest=o)
            st.latest = o
            if self.keep_token_ids:
                st.unsent_ids.extend(o.delta_token_ids)
        if self._done[i]:
            return
        self._observers[i].on_output(out)
        if self._spans is not None:
            self._spans[i].on_output(out)
        if out.finished:
            self._done[i] = True
            self.state.active_requests.discard(self.ids[i])

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    # -- summaries -------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(st.latest.token_ids) for st in self.choices.values())
        cached = sum(o.num_cached_tokens for o in self.final if o is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def ttft_s(self) -> float | None:
        """Seconds from the first engine request's arrival to the first token any of them
        generated: the engine's own stamps (`RequestMetrics`), None before a first token."""
        stamps = [o.metrics for o in self.final if o is not None and o.metrics is not None]
        firsts = [m.first_token_time for m in stamps if m.first_token_time is not None]
        if not firsts:
            return None
        return max(0.0, min(firsts) - min(m.arrival_time for m in stamps))

    def timing_headers(self) -> dict[str, str]:
        """A non-streamed answer's header with its time to first token (gateways read it)."""
        return ttft_header(self.ttft_s())

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.params.n + seq_index


async def generate(
    request: Request,
    state: ServerState,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[list[int]],
    params: SamplingParams,
    lora: str | None,
    prefix: str,
    param: str,
) -> tuple[Generation, dict[str, Any]]:
    """Run a chat or text completion's prompts (from the body's field `param`, under an id
    `prefix`-<hex>), with the head every chunk and response repeats: id, created, model."""
    created = int(time.time())
    gen = Generation(
        state,
        prompts,
        params,
        f"{prefix}-{uuid.uuid4().hex}",
        param,
        cache_salt=body.cache_salt,
        resume_token_ids=body.fleet_resume_token_ids,
        lora_name=lora,
    )
    await gen.run(request, stream=body.stream)
    return gen, {"id": gen.request_id, "created": created, "model": lora or state.settings.served_model_name}
