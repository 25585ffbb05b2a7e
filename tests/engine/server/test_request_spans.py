"""An engine request's spans built from its timestamps (no model): the shapes an early end,
a hand-over and a refusal leave behind."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from engine.errors import QueueFullError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.server import request_spans as rs
from fleet_base import tracing


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    with tracing.capturing() as sink:
        yield sink


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> rs.RequestSpans:
    return rs.RequestSpans(None, model="m", engine_request_id="cmpl-1", num_prompt_tokens=40)


def output(metrics: RequestMetrics, new: list[int], finish: str | None = None, n: int = 1) -> RequestOutput:
    outs = [CompletionOutput(index=j, delta_token_ids=new, finish_reason=finish) for j in range(n)]
    return RequestOutput("cmpl-1", None, list(range(40)), outs, finish is not None, 32, metrics)


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_finished_request_has_queue_prefill_decode_and_a_first_token_event(spans, exporter) -> None:
    t = time.monotonic() - 1.0
    m = RequestMetrics(t, t + 0.1, t + 0.3, t + 0.6, t + 0.7)
    spans.on_output(output(m, [1]))
    assert exporter.get_finished_spans() == ()  # nothing until the request ends
    spans.on_output(output(m, [2, 3], "length", n=2))
    got = by_name(exporter)
    assert set(got) == {rs.REQUEST_SPAN, rs.QUEUE_SPAN, rs.PREFILL_SPAN, rs.DECODE_SPAN}
    root = got[rs.REQUEST_SPAN]
    assert root.attributes[rs.COMPLETION_TOKENS] == 5 and root.attributes[rs.CACHED_TOKENS] == 32
    assert root.attributes[rs.FINISH_REASON] == "length,length"
    prefill = got[rs.PREFILL_SPAN].attributes
    assert (prefill[rs.CACHED_TOKENS], prefill[rs.COMPUTED_TOKENS]) == (32, 8)

    def ms(ns: int) -> float:
        return round((ns - root.start_time) / 1e6)

    assert [ms(got[n].start_time) for n in (rs.QUEUE_SPAN, rs.PREFILL_SPAN, rs.DECODE_SPAN)] == [0, 100, 300]
    assert [ms(got[n].end_time) for n in (rs.QUEUE_SPAN, rs.PREFILL_SPAN, rs.DECODE_SPAN)] == [100, 300, 600]
    assert ms(root.end_time) == 700
    (event,) = root.events
    assert event.name == rs.FIRST_TOKEN_EVENT and ms(event.timestamp) == 300


def test_aborted_while_queued_leaves_the_queue_wait_only(spans, exporter) -> None:
    spans.on_output(output(RequestMetrics(time.monotonic()), []))
    spans.abandon()
    spans.abandon()  # closing twice emits once
    got = by_name(exporter)
    assert set(got) == {rs.REQUEST_SPAN, rs.QUEUE_SPAN}
    assert got[rs.REQUEST_SPAN].attributes[rs.FINISH_REASON] == "abort"


def test_a_handed_over_stream_says_so(spans, exporter) -> None:
    t = time.monotonic()
    spans.on_output(output(RequestMetrics(t, t, t + 0.01, t + 0.02), [7, 8]))
    spans.abandon(handed_over=True)
    root = by_name(exporter)[rs.REQUEST_SPAN]
    assert root.attributes[rs.HANDED_OVER] is True and root.attributes[rs.COMPLETION_TOKENS] == 2
    assert rs.DECODE_SPAN in by_name(exporter)


def test_a_refused_request_is_one_error_span(spans, exporter) -> None:
    spans.fail(QueueFullError("full"))
    (span,) = exporter.get_finished_spans()
    assert span.name == rs.REQUEST_SPAN and span.status.status_code is StatusCode.ERROR
    assert span.attributes[tracing.REASON] == "QueueFullError"


def test_a_continuation_and_a_preempted_request_say_so(exporter) -> None:
    spans = rs.RequestSpans(
        None, model="m", engine_request_id="cmpl-2", num_prompt_tokens=40, resumed_tokens=9
    )
    t = time.monotonic()
    out = output(RequestMetrics(t, t, t, t, t), [1], "stop")
    out.num_preemptions = 2
    spans.on_output(out)
    root = by_name(exporter)[rs.REQUEST_SPAN]
    assert root.attributes[rs.RESUMED_TOKENS] == 9 and root.attributes[rs.PREEMPTIONS] == 2
