"""The asyncio front of the engine: per-request token streams and abort.

The engine loop runs on one background thread (torch releases the GIL in its kernels),
so the event loop stays free for HTTP. All engine mutations happen on that thread:
callers validate and tokenize on their side, then hand add/abort commands over a queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from engine.config import EngineArgs
from engine.continuation import check_resume
from engine.errors import (
    EngineDeadError,
    PromptTooLongError,
    QueueFullError,
    SlowReaderError,
    StepFailedError,
)
from engine.llm_engine import LLMEngine, PromptInput, StepError
from engine.lora import LoRAAdapter, LoRAAdapterError, LoRAManager
from engine.outputs import EngineStats, RequestOutput, approx_bytes
from engine.timing import HistogramSnapshot
from fleet_base.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 3


class _Stream:
    """One request's outputs on their way from the engine thread to its consumer.

    `unread` (touched on the event loop only) estimates what sits queued. A consumer that
    stops reading (its HTTP client does not read, so the server's send blocks) would let
    the queue grow for as long as the request runs; past `limit` the queue is dropped,
    the consumer finds `SlowReaderError` instead, and `on_overflow` aborts the request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, on_overflow: Callable[[], None]) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[RequestOutput | BaseException, int]] = asyncio.Queue()
        self.limit = limit
        self.on_overflow = on_overflow
        self.unread = 0
        self.cut = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the engine thread."""
        self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if self.cut:
            return
        if self.unread > self.limit:  # what arrives for a reader that keeps up always fits
            self._cut()
            return
        size = approx_bytes(item) if isinstance(item, RequestOutput) else 0
        self.unread += size
        self.queue.put_nowait((item, size))

    def _cut(self) -> None:
        self.cut = True
        while not self.queue.empty():
            self.queue.get_nowait()
        error = SlowReaderError(
            f"the client left more than {self.limit} bytes of output unread; the request was aborted"
        )
        self.unread = 0
        self.queue.put_nowait((error, 0))
        self.on_overflow()

    async def get(self) -> RequestOutput | BaseException:
        item, size = await self.queue.get()
        self.unread -= size
        return item


class AsyncLLM:
    def __init__(self, model: str = "smollm2-135m", served_model_name: str | None = None, **engine_args: Any):
        self.args = EngineArgs(model=model, **engine_args)
        self.engine = LLMEngine(self.args)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_model_len = self.engine.max_model_len
        self.kv_events = self.engine.kv_events  # thread-safe: read by the server's /kv/events
        self.served_model_name = served_model_name or model
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._pending = 0  # adds handed over but not yet applied (counted against the queue limit)
        self._failed_steps = 0  # consecutive
        self.num_aborted_slow_reader = 0
        # Liveness: when the loop last made progress (a step, or found nothing to do), and
        # a test hook that makes it hang the way a stuck kernel would.
        self._progress_at = time.monotonic()
        self._frozen = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (event loop) --------------------------------------------------------
    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput per step with new tokens; the last one has finished=True.
        `resume_token_ids`: continue a generation that produced these (engine.continuation)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = self.engine.tokenize_prompt(prompt)
        self.engine.lora_adapter(lora_name)  # an unknown adapter fails here, before queueing
        max_tokens = params.max_tokens if params.max_tokens is not None else 1
        if len(ids) + max_tokens > self.max_model_len:
            raise PromptTooLongError(len(ids), max_tokens, self.max_model_len)
        if len(self.engine.scheduler.waiting) + self._pending + params.n > self.args.max_queue_len:
            raise QueueFullError(f"the waiting queue is full ({self.args.max_queue_len} requests)")

        if params.structured is not None:  # compile (or hit the cache) off the engine thread
            await asyncio.to_thread(self.engine.grammar.compile, params.structured)
        stream = _Stream(
            asyncio.get_running_loop(), self.args.max_unread_bytes, lambda: self._slow_reader(request_id)
        )
        self._streams[request_id] = stream
        self._pending += params.n
        if resume_token_ids:
            check_resume(params, resume_token_ids, self.model_config.vocab_size)
        self._send(
            "add", (ids, params, request_id, priority, cache_salt, prompt, resume_token_ids, lora_name)
        )
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            if not finished:
                self._send("abort", request_id)
            self._streams.pop(request_id, None)

    # -- LoRA adapters (the manager is thread-safe; reading files stays off the loop) -----
    @property
    def lora(self) -> LoRAManager | None:
        return self.engine.lora

    async def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load and register an adapter; `LoRAAdapterError` (nothing changed) when it cannot be."""
        if self.lora is None:
            raise LoRAAdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        return await asyncio.to_thread(self.lora.add, name, path, (self.served_model_name,))

    def remove_lora(self, name: str) -> LoRAAdapter | None:
        return self.lora.remove(name) if self.lora is not None else None

    def list_loras(self) -> list[LoRAAdapter]:
        return self.lora.list() if self.lora is not None else []

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _slow_reader(self, request_id: str) -> None:
        self.num_aborted_slow_reader += 1
        log.info("request %s: aborted, its client left too much output unread", request_id)
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        return replace(self.engine.stats(), num_aborted_slow_reader=self.num_aborted_slow_reader)

    def grammar_timings(self) -> dict[str, HistogramSnapshot]:
        """Grammar compile and per-step mask-fill durations (for the server's /metrics)."""
        return self.engine.grammar_timings()

    def stalled_for(self) -> float:
        """Seconds the loop has had work and made no step (0 when idle or progressing)."""
        if not self._streams and self._pending <= 0:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    def freeze(self, frozen: bool = True) -> None:
        """Test hook: the loop stops stepping (as if a kernel hung) until unfrozen."""
        if frozen:
            self._frozen.set()
        else:
            self._frozen.clear()
            self._wake.set()

    def corrupt(self, corrupted: bool = True) -> None:
        """Test hook: generation answers wrongly (each sampled token perturbed) until undone."""
        self.engine.corrupt = corrupted

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _send(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        self._wake.set()

    # -- engine thread -------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                ids, params, rid, priority, salt, prompt, resume, lora_name = payload
                self._pending -= params.n
                stream = self._streams.get(rid)
                if stream is None:  # the caller went away before we got to it
                    continue
                try:
                    self.engine.add_request(
                        ids,
                        params,
                        rid,
                        priority=priority,
                        stream=True,
                        cache_salt=salt,
                        prompt_text=prompt if isinstance(prompt, str) else None,
                        resume_token_ids=resume,
                        lora_name=lora_name,
                    )
                except Exception as err:  # validation raced with the queue filling up
                    stream.put(err)
            elif kind == "abort":
                out = self.engine.abort_request(payload)
                stream = self._streams.get(payload)
                if out is not None and stream is not None:
                    stream.put(out)

    def _hang_while_frozen(self) -> None:
        while self._frozen.is_set() and not self._stopping:
            time.sleep(0.05)

    def _step(self) -> list[RequestOutput]:
        """One engine step. A step whose failure the engine pins on some requests fails
        those alone (their clients get an error) and the rest go on. A failure it cannot
        pin fails every request of the step; `MAX_FAILED_STEPS` of those in a row mean the
        engine itself is broken, and the loop dies (the replica is restarted)."""
        try:
            outs = self.engine.step()
        except StepError as err:
            self._failed_steps += 1
            log.error(
                "engine step failed, no request to blame (%d in a row): %r", self._failed_steps, err.cause
            )
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise err.cause from err
            failure = StepFailedError(f"this request's engine step failed: {err.cause!r}")
            for rid in err.request_ids:
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.put(failure)
            self.engine.fail_requests(err.request_ids)
            return []
        self._failed_steps = 0
        for rid, failure in self.engine.take_failures():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(failure)
        return outs

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                self._hang_while_frozen()
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self._progress_at = time.monotonic()
                while self.engine.has_unfinished_requests() and not self._stopping:
                    self._hang_while_frozen()
                    for out in self._step():
                        stream = self._streams.get(out.request_id)
                        if stream is not None:
                            stream.put(out)
                    self._progress_at = time.monotonic()
                    self._apply_commands()
        except BaseException as err:  # a bug or an OOM: fail every stream loudly
            log.exception("engine loop died")
            self._dead = err
            dead = EngineDeadError(f"the engine loop died: {err!r}")
            for stream in list(self._streams.values()):
                stream.put(dead)
