"""One trace across real processes: a client's streamed chat request enters gateway "east",
which has no replica and forwards it to its peer "west"; west's replica (a simulated one,
listed twice) cuts the stream after token 3 and west migrates it to the other entry. Every
process exports OTLP/HTTP protobuf to a real receiver (`tests.tracing_receiver`), and the
one trace holds spans of three processes whose parent links chain: client -> east's server
span -> east's attempt -> west's server span -> west's attempts -> the replica's spans."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet_base import tracing
from fleet_base.ports import free_port
from tests.agent.gateway.conftest import EAST
from tests.agent.gateway.harness import (
    DEPLOYMENT,
    GatewayProcess,
    make_key,
    peer,
    replica,
    route,
    start_sim,
)
from tests.polling import wait_for
from tests.tracing_receiver import ReceivedSpan, TraceReceiver

WEST = (34.05, -118.24)
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "the secret plan is purple elephants"
CUT_AT = 3
MAX_TOKENS = 32  # ~1.5 s of the default profile: the cut at token 3 is mid-stream even on a slow box


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[TraceReceiver]:
    """The sink, and the standard env every process started here inherits."""
    with TraceReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        for name in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER"):
            monkeypatch.delenv(name, raising=False)
        yield rx


@pytest.fixture
def fleet(receiver: TraceReceiver, tmp_path: Path) -> Iterator[tuple[GatewayProcess, GatewayProcess, str]]:
    proc, sim_url = start_sim("--cut-stream-at", str(CUT_AT))
    dead_nats = f"nats://127.0.0.1:{free_port()}"  # serving must not care
    east = GatewayProcess(
        tmp_path / "east", "east", nats_url=dead_nats, lat=EAST[0], lon=EAST[1], access_log=True
    )
    west = GatewayProcess(
        tmp_path / "west", "west", nats_url=dead_nats, lat=WEST[0], lon=WEST[1], access_log=True
    )
    try:
        east.start()
        west.start()
        wait_for(lambda: httpx.get(f"{sim_url}/health", timeout=1).status_code == 200, 30, "the sim", 0.1,
                 retry_errors=httpx.TransportError)  # fmt: skip
        yield east, west, sim_url
    finally:
        east.stop()
        west.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_a_forwarded_migrated_stream_is_one_trace_over_three_processes(
    fleet: tuple[GatewayProcess, GatewayProcess, str], receiver: TraceReceiver
) -> None:
    east, west, sim_url = fleet
    secret, record = make_key("traced")
    table = route(DEPLOYMENT, [peer("east", east.url, *EAST, replicas=0), peer("west", west.url, *WEST)])
    east.write(replicas=[], keys=[record], routes=[table])
    west.write(replicas=[replica("r1", sim_url), replica("r2", sim_url)], keys=[record], routes=[table])

    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {secret}", "traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}
    with httpx.stream("POST", f"{east.url}/v1/chat/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-fleet-cluster"] == "west"
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in c for c in chunks)
    assert sum(len(c["choices"][0]["delta"].get("content") or "") > 0 for c in chunks if c["choices"]) >= 2

    def complete() -> list[ReceivedSpan] | None:
        spans = receiver.trace(TRACE)
        names = [s.name for s in spans]
        servers = names.count("gateway.request") == 2 and names.count("sim.request") == 2
        return spans if servers and "gateway.migration" in names else None

    spans = wait_for(complete, 20, "the whole trace at the receiver", 0.1)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    east_side = [s for s in spans if s.resource.get(tracing.CLUSTER) == "east"]
    west_side = [s for s in spans if s.resource.get(tracing.CLUSTER) == "west"]
    sims = [s for s in spans if s.service == "fleet-sim"]
    assert {s.service for s in east_side + west_side} == {"fleet-gateway"}
    assert len({s.resource["process.pid"] for s in spans}) == 3  # three processes, one trace
    assert len(east_side) + len(west_side) + len(sims) == len(spans)

    def one(side: list[ReceivedSpan], name: str) -> ReceivedSpan:
        (found,) = [s for s in side if s.name == name]
        return found

    # east: the client's span is the parent; every step is a child of east's server span
    east_server = one(east_side, "gateway.request")
    assert east_server.parent_span_id == CLIENT_SPAN and east_server.kind == 2  # SERVER
    assert east_server.attributes[tracing.STATUS] == 200
    assert (
        east_server.attributes[tracing.KEY_ID] == "traced" and east_server.attributes["fleet.peer"] == "west"
    )
    for s in east_side:
        if s is not east_server:
            assert s.parent_span_id == east_server.span_id, s.name
    assert {s.name for s in east_side} >= {
        "gateway.auth",
        "gateway.quota",
        "gateway.route",
        "gateway.attempt",
    }
    route_east = one(east_side, "gateway.route")
    assert route_east.attributes[tracing.STAGE] == "peer" and route_east.attributes["fleet.target"] == "west"
    assert route_east.attributes["fleet.stages"] == ["peer"]
    east_attempt = one(east_side, "gateway.attempt")
    assert east_attempt.attributes["fleet.peer"] == "west" and east_attempt.kind == 3  # CLIENT

    # west continues the trace under east's attempt; its attempts and migration under its server span
    west_server = one(west_side, "gateway.request")
    assert west_server.parent_span_id == east_attempt.span_id
    assert west_server.attributes["fleet.forwarded_from"] == "east"
    for s in west_side:
        if s is not west_server:
            assert s.parent_span_id == west_server.span_id, s.name
    attempts = sorted(
        (s for s in west_side if s.name == "gateway.attempt"), key=lambda s: s.attributes[tracing.ATTEMPT]
    )
    assert [a.attributes[tracing.ATTEMPT] for a in attempts] == [1, 2]
    assert {a.attributes[tracing.REPLICA] for a in attempts} == {"r1", "r2"}
    assert attempts[0].status_code == 2 and attempts[0].attributes[tracing.REASON].startswith("midstream_")
    migration = one(west_side, "gateway.migration")
    assert migration.attributes["fleet.from"] == attempts[0].attributes[tracing.REPLICA]
    assert migration.attributes["fleet.to"] == attempts[1].attributes[tracing.REPLICA]
    assert west_server.attributes[tracing.COMPLETION_TOKENS] == MAX_TOKENS

    # the replica: one span per leg, each the child of west's attempt that opened it
    assert sorted(s.parent_span_id for s in sims) == sorted(a.span_id for a in attempts)
    resumed = [s for s in sims if s.attributes.get("fleet.resumed_tokens")]
    assert len(resumed) == 1 and resumed[0].parent_span_id == attempts[1].span_id

    # never any text of the request in a span; the access log leads to the trace
    for s in spans:
        assert not any(isinstance(v, str) and "elephant" in v for v in s.attributes.values()), s.name
    wait_for(lambda: f"trace_id={TRACE}" in east.log_path.read_text(), 5, "east's access log line")
