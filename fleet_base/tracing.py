"""OpenTelemetry traces for every fleet process: one setup, W3C propagation over plain headers.

Tracing is off unless the standard environment turns it on: `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set and `OTEL_SDK_DISABLED` is not true (and
`OTEL_TRACES_EXPORTER` is not "none"). The SDK itself honours the rest of the standard variables
(`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`,
`OTEL_EXPORTER_OTLP_*HEADERS/TIMEOUT/CERTIFICATE`). Spans go through a BatchSpanProcessor, so
exporting never blocks a request; when tracing is off every helper here returns at once with the
API's invalid span, which records nothing and injects nothing.

Spans carry identifiers and numbers only (deployment, model, key id, tokens, status, stage,
reason, replica, attempt, cluster): never prompt or output text, never a key's secret.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACER_NAME = "fleet"
TRACE_HEADERS = ("traceparent", "tracestate")
_TRUE = {"1", "true", "yes", "on"}

_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer = trace.NoOpTracer()
_enabled = False

# Attribute names shared by every component's spans (identifiers and counts only).
DEPLOYMENT = "fleet.deployment"
MODEL = "fleet.model"
KEY_ID = "fleet.key_id"
PROMPT_TOKENS = "fleet.tokens.prompt"
COMPLETION_TOKENS = "fleet.tokens.completion"
STATUS = "fleet.status"
STAGE = "fleet.stage"
REASON = "fleet.reason"
REPLICA = "fleet.replica"
ATTEMPT = "fleet.attempt"
CLUSTER = "fleet.cluster"

SERVER = SpanKind.SERVER
CLIENT = SpanKind.CLIENT
INTERNAL = SpanKind.INTERNAL


def configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether the standard OTEL_* variables ask for trace export (OTLP/HTTP)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(component: str, *, attributes: Mapping[str, str | int] | None = None) -> bool:
    """Turn tracing on for this process when the environment asks for it; returns whether on.

    `component` is the service name unless `OTEL_SERVICE_NAME` sets one; `attributes` add
    resource attributes (e.g. `fleet.cluster`). Idempotent: the first call per process wins.
    """
    if _enabled or not configured():
        return _enabled
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if protocol and protocol != "http/protobuf":
        log.warning("tracing: OTLP protocol %r is not supported; exporting http/protobuf", protocol)
    _install(_provider_for(component, attributes), BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing: on (service %s)", os.environ.get("OTEL_SERVICE_NAME") or component)
    return True


def _provider_for(component: str, attributes: Mapping[str, str | int] | None) -> TracerProvider:
    attrs: dict[str, str | int] = {"fleet.component": component, "process.pid": os.getpid()}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = component
    attrs.update(attributes or {})
    return TracerProvider(resource=Resource.create(attrs))


def _install(provider: TracerProvider, processor: Any) -> None:
    global _provider, _tracer, _enabled
    provider.add_span_processor(processor)
    _provider, _tracer, _enabled = provider, provider.get_tracer(TRACER_NAME), True


def capture(component: str = "test", exporter: SpanExporter | None = None) -> InMemorySpanExporter:
    """Tests: record this process's spans synchronously in memory; `reset()` turns it off again."""
    reset()
    sink = exporter if exporter is not None else InMemorySpanExporter()
    _install(_provider_for(component, None), SimpleSpanProcessor(sink))
    return sink  # type: ignore[return-value]


@contextmanager
def capturing(component: str = "test") -> Iterator[InMemorySpanExporter]:
    """`with capturing() as spans: ...; spans.get_finished_spans()`, then tracing is off again."""
    sink = capture(component)
    try:
        yield sink
    finally:
        reset()


def reset() -> None:
    """Flush and turn tracing off (tests; process exit flushes by itself)."""
    global _provider, _tracer, _enabled
    if _provider is not None:
        _provider.shutdown()
    _provider, _tracer, _enabled = None, trace.NoOpTracer(), False


def flush(timeout_ms: int = 5000) -> None:
    """Export what is queued now (before a process exits on its own terms)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    """The process tracer ("fleet"); a no-op tracer while tracing is off."""
    return _tracer


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None and isinstance(headers, dict):
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent in incoming W3C `traceparent`/`tracestate` headers (None if absent/off)."""
    if not _enabled or not headers:
        return None
    carrier = {k: v for k in TRACE_HEADERS if (v := _header(headers, k)) is not None}
    return _propagator.extract(carrier) if "traceparent" in carrier else None


def inject(headers: MutableMapping[str, str], span: Span | None = None) -> MutableMapping[str, str]:
    """Add `traceparent` (and `tracestate`) for `span` (else the current span) to outgoing headers."""
    if not _enabled:
        return headers
    ctx = trace.set_span_in_context(span) if span is not None else None
    _propagator.inject(headers, context=ctx)
    return headers


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return {k: v for k, v in attributes.items() if v is not None} if attributes else None


def start_span(
    name: str,
    *,
    parent: Span | Context | None = None,
    headers: Mapping[str, str] | None = None,
    kind: SpanKind = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Span:
    """Start (not enter) a span; the caller ends it. The parent is `parent` (a span or a
    context), else the trace in `headers`, else the current span; a new trace when none.
    Attributes whose value is None are dropped. Off: the invalid span, at ~no cost."""
    if not _enabled:
        return INVALID_SPAN
    if isinstance(parent, Span):
        ctx: Context | None = trace.set_span_in_context(parent)
    elif parent is not None:
        ctx = parent
    else:
        ctx = extract(headers)
    return _tracer.start_span(name, context=ctx, kind=kind, attributes=_clean(attributes))


@contextmanager
def span(
    name: str,
    *,
    parent: Span | Context | None = None,
    headers: Mapping[str, str] | None = None,
    kind: SpanKind = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """`start_span` as a block: current inside, ended on exit, an exception marks it an error."""
    if not _enabled:
        yield INVALID_SPAN
        return
    s = start_span(name, parent=parent, headers=headers, kind=kind, attributes=attributes)
    with trace.use_span(s, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield s
        except BaseException as e:
            fail(s, type(e).__name__)
            raise


def set_attributes(s: Span, attributes: Mapping[str, Any]) -> None:
    """Set attributes on a span, dropping None values (a no-op when off)."""
    if _enabled and s.is_recording():
        s.set_attributes({k: v for k, v in attributes.items() if v is not None})


def fail(s: Span, reason: str) -> None:
    """Mark a span an error with a short reason code (never a message with user text)."""
    if _enabled and s.is_recording():
        s.set_status(Status(StatusCode.ERROR, reason))
        s.set_attribute(REASON, reason)


def trace_id(s: Span | None = None) -> str | None:
    """The 32-hex trace id of `s` (else the current span), for log lines; None when untraced."""
    if not _enabled:
        return None
    ctx = (s if s is not None else trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
