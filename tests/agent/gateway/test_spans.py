"""A request's spans at the gateway (agent.gateway.spans), in process with an in-memory exporter."""

from __future__ import annotations

import logging

import pytest

from agent.gateway.errors import GatewayError
from agent.gateway.exchange import Progress
from agent.gateway.plan import Attempt, Plan
from agent.gateway.spans import RequestTrace
from fleet_base import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def sink():
    with tracing.capturing("fleet-gateway") as spans:
        yield spans


def by_name(sink) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in sink.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


@pytest.mark.parametrize(
    ("plan", "stage", "reason", "target"),
    [
        (Plan((Attempt("local", "prefix", "r2"), Attempt("local", "retry", "r1"))), "local", "prefix", "r2"),
        (Plan((Attempt("local", "wait-for-replica"),)), "local", "wait-for-replica", None),
        (
            Plan((Attempt("peer", "no-local-replica", "west", is_peer=True),)),
            "peer",
            "no-local-replica",
            "west",
        ),
        (Plan(residency_unavailable=True), None, "residency", None),
    ],
)
def test_the_routing_span_names_the_stage_and_why(sink, plan, stage, reason, target) -> None:
    trace = RequestTrace.begin("req-1", "east", {}, "chat")
    trace.routed(plan)
    (route,) = by_name(sink)["gateway.route"]
    assert route.attributes.get(tracing.STAGE) == stage
    assert route.attributes[tracing.REASON] == reason
    assert route.attributes.get("fleet.target") == target


def test_steps_and_numbered_attempts_are_children_of_one_server_span(sink, caplog) -> None:
    trace = RequestTrace.begin("req-1", "east", {"traceparent": PARENT}, "chat")
    with pytest.raises(GatewayError), trace.step("gateway.quota"):
        raise GatewayError(429, "over", code="rate_limit_exceeded")
    first = trace.attempt(Attempt("local", "least-load", "r1"))
    first.end()
    trace.attempt(Attempt("failover", "nearest", "west", is_peer=True)).end()
    progress = Progress(usage={"prompt_tokens": 5, "completion_tokens": 7}, peer="west")
    with caplog.at_level(logging.INFO, logger="agent.gateway.access"):
        trace.finish(200, progress=progress, key_id="k1")
        trace.finish(500)  # once only
    spans = by_name(sink)
    (server,) = spans["gateway.request"]
    assert format(server.parent.span_id, "016x") == PARENT.split("-")[2]
    assert server.attributes[tracing.STATUS] == 200 and server.attributes[tracing.COMPLETION_TOKENS] == 7
    (quota,) = spans["gateway.quota"]
    assert (
        quota.attributes[tracing.REASON] == "rate_limit_exceeded" and quota.status.status_code.name == "ERROR"
    )
    attempts = spans["gateway.attempt"]
    assert [a.attributes[tracing.ATTEMPT] for a in attempts] == [1, 2]
    assert attempts[0].attributes[tracing.REPLICA] == "r1" and attempts[1].attributes["fleet.peer"] == "west"
    for s in (quota, *attempts):
        assert s.parent.span_id == server.context.span_id
    (line,) = [r.getMessage() for r in caplog.records if r.name == "agent.gateway.access"]
    assert "status=200" in line and f"trace_id={PARENT.split('-')[1]}" in line and "peer=west" in line


def test_off_records_nothing_and_logs_no_trace_id(caplog) -> None:
    tracing.reset()
    trace = RequestTrace.begin("req-2", "east", {"traceparent": PARENT}, "chat")
    with trace.step("gateway.auth") as span:
        assert not span.is_recording()
    assert not trace.attempt(Attempt("local", "least-load", "r1")).is_recording()
    with caplog.at_level(logging.INFO, logger="agent.gateway.access"):
        trace.finish(200)
    assert trace.attempts == 1
    assert [r.getMessage().endswith("trace_id=-") for r in caplog.records] == [True]


def test_a_request_sampled_out_makes_no_child_spans_but_passes_its_context_on(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    with tracing.capturing() as sink:
        trace = RequestTrace.begin("req-3", "east", {}, "chat")
        with trace.step("gateway.auth"):
            pass
        trace.routed(Plan((Attempt("local", "least-load", "r1"),)))
        attempt = trace.attempt(Attempt("local", "least-load", "r1"))
        headers = tracing.inject({}, attempt)
        trace.finish(200)
        assert sink.get_finished_spans() == ()
    assert not trace.recording and int(headers["traceparent"].split("-")[3], 16) & 1 == 0  # not sampled
