"""One engine request's trace: a span, child of the caller's W3C context, with queue, prefill
and decode children and the first token as an event.

The spans are built at the edge, in the server, once per request when its stream ends, from
the timestamps the engine already stamps for its latency metrics (`RequestMetrics`: arrival,
first scheduled, first token, last token, finished). Nothing runs in the engine loop, there is
no second clock, and with tracing off the server makes none of these objects. Spans carry
token counts, never prompt or output text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, set_span_in_context

from engine.outputs import RequestMetrics, RequestOutput
from fleet_base import tracing

REQUEST_SPAN = "engine.request"
QUEUE_SPAN = "engine.queue"
PREFILL_SPAN = "engine.prefill"
DECODE_SPAN = "engine.decode"
FIRST_TOKEN_EVENT = "first_token"
# The header a gateway names its request with (agent.gateway.upstream sends it to replicas).
REQUEST_ID_HEADER = "x-request-id"

# attribute names: the fleet-wide ones from fleet_base.tracing, and the engine's own
MODEL = tracing.MODEL
PROMPT_TOKENS = tracing.PROMPT_TOKENS
COMPLETION_TOKENS = tracing.COMPLETION_TOKENS
FINISH_REASON = "fleet.finish_reason"  # one per sequence, comma-separated when n > 1
REQUEST_ID = "fleet.request_id"  # the caller's X-Request-Id (the gateway's request id)
ENGINE_REQUEST_ID = "fleet.engine.request_id"
CACHED_TOKENS = "fleet.tokens.cached"  # prompt tokens read from the prefix cache
COMPUTED_TOKENS = "fleet.tokens.computed"  # prompt tokens the prefill computed
HANDED_OVER = "fleet.engine.handed_over"
RESUMED_TOKENS = "fleet.resumed_tokens"  # a continuation: tokens generated before (as the sim replica says)
PREEMPTIONS = "fleet.engine.preemptions"
TTFT = "fleet.ttft_s"
QUEUE_TIME = "fleet.queue_s"


class _Clock:
    """The engine's `time.monotonic` stamps as Unix nanoseconds (what spans take)."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, mono: float) -> int:
        return int(mono * 1e9) + self.offset_ns


class RequestSpans:
    """Collects what one engine request's outputs say (cheaply, per output) and turns it into
    spans once, when the request finishes, is abandoned or fails admission. Made only while
    tracing is on (`fleet_base.tracing.enabled()`)."""

    def __init__(
        self,
        parent: Context | None,
        *,
        model: str,
        engine_request_id: str,
        num_prompt_tokens: int,
        request_id: str | None = None,
        resumed_tokens: int = 0,
    ) -> None:
        self.tracer = tracing.tracer()
        self.parent = parent
        self.attributes: dict[str, str | int] = {
            MODEL: model,
            ENGINE_REQUEST_ID: engine_request_id,
            PROMPT_TOKENS: num_prompt_tokens,
        }
        if request_id:
            self.attributes[REQUEST_ID] = request_id
        if resumed_tokens:
            self.attributes[RESUMED_TOKENS] = resumed_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.started = time.monotonic()  # arrival, until the engine's own stamp comes
        self.metrics: RequestMetrics | None = None
        self.cached = 0
        self.preemptions = 0
        self.output_tokens = 0
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if out.metrics is not None:
            self.metrics = out.metrics
        self.num_prompt_tokens = len(out.prompt_token_ids)
        self.cached = out.num_cached_tokens
        self.preemptions = out.num_preemptions
        for o in out.outputs:
            self.output_tokens += len(o.delta_token_ids)
        if out.finished:
            self._emit([o.finish_reason or "abort" for o in out.outputs])

    def abandon(self, handed_over: bool = False) -> None:
        """The stream ended early: the client left, or a draining replica handed it over."""
        if not self.done:
            self._emit(["abort"], {HANDED_OVER: True} if handed_over else None)

    def fail(self, error: BaseException) -> None:
        """Refused before anything ran (context overflow, full queue): one span, error status."""
        if self.done:
            return
        self.done = True
        clock = _Clock()
        span = self.tracer.start_span(
            REQUEST_SPAN,
            self.parent,
            SpanKind.SERVER,
            attributes=self.attributes,
            start_time=clock.ns(self.started),
        )
        tracing.fail(span, type(error).__name__)
        span.end()

    def _emit(self, finish_reasons: Sequence[str], extra: dict[str, bool] | None = None) -> None:
        self.done = True
        now = time.monotonic()
        clock = _Clock()
        m = self.metrics or RequestMetrics(arrival_time=self.started)
        arrival = m.arrival_time
        end = m.finished_time or now
        scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        attrs = {
            **self.attributes,
            PROMPT_TOKENS: self.num_prompt_tokens,
            **(extra or {}),
            COMPLETION_TOKENS: self.output_tokens,
            CACHED_TOKENS: self.cached,
            FINISH_REASON: ",".join(finish_reasons),
        }
        if self.preemptions:
            attrs[PREEMPTIONS] = self.preemptions
        if first is not None:
            attrs[TTFT] = first - arrival
        if scheduled is not None:
            attrs[QUEUE_TIME] = scheduled - arrival
        root = self.tracer.start_span(
            REQUEST_SPAN, self.parent, SpanKind.SERVER, attributes=attrs, start_time=clock.ns(arrival)
        )
        inner = set_span_in_context(root)

        def child(name: str, start: float, stop: float, attributes: dict[str, int]) -> None:
            span = self.tracer.start_span(name, inner, attributes=attributes, start_time=clock.ns(start))
            span.end(end_time=clock.ns(max(stop, start)))

        child(QUEUE_SPAN, arrival, scheduled if scheduled is not None else end, {})
        if scheduled is not None:
            computed = max(self.num_prompt_tokens - self.cached, 0)
            child(
                PREFILL_SPAN,
                scheduled,
                first if first is not None else end,
                {
                    PROMPT_TOKENS: self.num_prompt_tokens,
                    CACHED_TOKENS: self.cached,
                    COMPUTED_TOKENS: computed,
                },
            )
        if first is not None:
            root.add_event(FIRST_TOKEN_EVENT, {TTFT: first - arrival}, timestamp=clock.ns(first))
            child(
                DECODE_SPAN, first, last if last is not None else end, {COMPLETION_TOKENS: self.output_tokens}
            )
        root.end(end_time=clock.ns(max(end, arrival)))
