"""fleet_base.tracing: off unless OTEL_* asks, W3C propagation over plain headers, real export."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry.trace import INVALID_SPAN

from fleet_base import tracing
from tests.tracing_receiver import TraceReceiver

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _off():
    tracing.reset()
    yield
    tracing.reset()


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
    ],
)
def test_configured_only_by_the_standard_env(env, on):
    assert tracing.configured(env) is on


def test_off_is_a_no_op():
    assert not tracing.enabled()
    s = tracing.start_span("x", headers={"traceparent": PARENT})
    assert s is INVALID_SPAN
    assert tracing.inject({}, s) == {}
    assert tracing.extract({"traceparent": PARENT}) is None
    assert tracing.trace_id(s) is None
    with tracing.span("y") as t:
        tracing.set_attributes(t, {tracing.STAGE: "a"})
        assert t is INVALID_SPAN


def test_child_of_incoming_headers_and_injected_downstream():
    with tracing.capturing() as sink:
        server = tracing.start_span(
            "server", headers={"TraceParent": PARENT, "tracestate": "v=1"}, kind=tracing.SERVER
        )
        with tracing.span("auth", parent=server, attributes={tracing.KEY_ID: "k1", tracing.MODEL: None}):
            pass
        out = tracing.inject(
            {}, tracing.start_span("attempt", parent=server, attributes={tracing.ATTEMPT: 1})
        )
        server.end()
        assert tracing.trace_id(server) == PARENT.split("-")[1]
        spans = {s.name: s for s in sink.get_finished_spans()}
    assert spans["server"].context.trace_id == int(PARENT.split("-")[1], 16)
    assert spans["server"].parent.span_id == int(PARENT.split("-")[2], 16)
    assert spans["auth"].parent.span_id == spans["server"].context.span_id
    assert dict(spans["auth"].attributes) == {tracing.KEY_ID: "k1"}
    assert out["traceparent"].split("-")[1] == PARENT.split("-")[1]
    assert out["tracestate"] == "v=1"


def test_no_incoming_context_starts_a_trace_and_errors_are_marked():
    with tracing.capturing() as sink:
        with pytest.raises(ValueError), tracing.span("root"):
            raise ValueError("boom")
        (root,) = sink.get_finished_spans()
    assert root.parent is None
    assert root.status.status_code.name == "ERROR"
    assert root.attributes[tracing.REASON] == "ValueError"


def test_a_process_exports_otlp_http_protobuf_to_a_real_receiver():
    """setup() from the env alone, BatchSpanProcessor, flushed at exit: the receiver decodes it."""
    code = textwrap.dedent(
        """
        from fleet_base import tracing
        assert tracing.setup("probe", attributes={tracing.CLUSTER: "eu"})
        with tracing.span("work", attributes={tracing.DEPLOYMENT: "d"}):
            pass
        """
    )
    with TraceReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_SERVICE_NAME": "svc", "PATH": ""}
        subprocess.run([sys.executable, "-c", code], env=env | _pythonpath(), check=True, timeout=30)
        (work,) = rx.spans()
    assert work.name == "work" and work.attributes == {tracing.DEPLOYMENT: "d"}
    assert work.service == "svc" and work.resource[tracing.CLUSTER] == "eu"
    assert work.resource["fleet.component"] == "probe"


def _pythonpath() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(sys.path)}
