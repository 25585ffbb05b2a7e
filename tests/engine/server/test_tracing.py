"""Traces from the real engine behind its OpenAI server (in process, SmolLM2): a request that
carries a W3C `traceparent` gets an engine span in that trace with queue, prefill and decode
under it and a first-token event; a repeated prompt's prefill reads from the prefix cache; with
tracing off nothing is made and requests are served as before. An unstreamed answer's
`x-fleet-ttft-s` header is the same stamps' TTFT."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine import AsyncLLM
from engine.server import generation
from engine.server import request_spans as rs
from engine.server.app import build_app, new_state
from engine.server.state import ServerSettings, ServerState
from fleet_base import tracing
from fleet_base.openai_contract.timing import TTFT_HEADER

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
# longer than two KV blocks (16 tokens each), so a repeat finds whole blocks cached
PROMPT = "The river runs north through the valley, past the mill and the old stone bridge, " * 2


@pytest.fixture(scope="module")
def state(smollm2_gguf) -> Iterator[ServerState]:
    engine = AsyncLLM(MODEL, show_progress=False, max_model_len=512)
    state = new_state(ServerSettings(served_model_name=MODEL), engine)
    yield state
    engine.shutdown()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    with tracing.capturing("fleet-engine") as sink:
        yield sink


@pytest.fixture
async def client(state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=120) as c:
        yield c


async def complete(client: httpx.AsyncClient, stream: bool = False, **headers: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": stream}
    r = await client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def request_tree(spans: list[ReadableSpan]) -> tuple[ReadableSpan, dict[str, ReadableSpan]]:
    (root,) = [s for s in spans if s.name == rs.REQUEST_SPAN]
    children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id}
    return root, children


async def test_a_traced_request_is_a_child_of_the_caller_with_queue_prefill_decode(client, exporter) -> None:
    await complete(client, traceparent=TRACEPARENT, **{"x-request-id": "req-abc"})
    first = list(exporter.get_finished_spans())
    root, children = request_tree(first)
    assert f"{root.context.trace_id:032x}" == TRACE_ID and f"{root.parent.span_id:016x}" == CALLER_SPAN
    assert set(children) == {rs.QUEUE_SPAN, rs.PREFILL_SPAN, rs.DECODE_SPAN}
    assert all(s.context.trace_id == root.context.trace_id for s in first)
    attrs = root.attributes
    assert attrs[rs.MODEL] == MODEL and attrs[rs.REQUEST_ID] == "req-abc"
    assert attrs[rs.ENGINE_REQUEST_ID].startswith("cmpl-") and attrs[rs.COMPLETION_TOKENS] == 3
    assert attrs[rs.FINISH_REASON] == "length"
    assert [e.name for e in root.events] == [rs.FIRST_TOKEN_EVENT]
    queue, prefill, decode = (children[n] for n in (rs.QUEUE_SPAN, rs.PREFILL_SPAN, rs.DECODE_SPAN))
    assert root.start_time == queue.start_time <= queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time == root.events[0].timestamp <= decode.end_time
    assert decode.end_time <= root.end_time
    num_prompt = prefill.attributes[rs.PROMPT_TOKENS]
    assert num_prompt > 32 and decode.attributes[rs.COMPLETION_TOKENS] == 3
    # no text in any span: every attribute value is a number, an id, the model or a finish reason
    for span in first:
        for value in span.attributes.values():
            assert "river" not in str(value)

    # the same prompt again, streamed: its prefill reads whole blocks from the prefix cache
    exporter.clear()
    await complete(client, stream=True, traceparent=TRACEPARENT)
    _, children = request_tree(list(exporter.get_finished_spans()))
    again = children[rs.PREFILL_SPAN].attributes
    assert again[rs.CACHED_TOKENS] >= 32
    assert again[rs.CACHED_TOKENS] + again[rs.COMPUTED_TOKENS] == num_prompt


async def test_without_a_traceparent_the_engine_span_starts_a_trace(client, exporter) -> None:
    await complete(client)
    root, children = request_tree(list(exporter.get_finished_spans()))
    assert root.parent is None and len(children) == 3


async def test_tracing_off_makes_nothing(client, monkeypatch) -> None:
    assert not tracing.enabled()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a span object was made with tracing off")

    monkeypatch.setattr(generation, "RequestSpans", refuse)
    r = await complete(client, traceparent=TRACEPARENT)
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_an_unstreamed_answer_says_its_ttft_from_the_engine_stamps(client, exporter) -> None:
    """`x-fleet-ttft-s` is the engine span's own TTFT (the same stamps, no second clock), on
    every unstreamed endpoint, and absent from a stream (its reader times the first token)."""
    r = await complete(client)
    root, _ = request_tree(list(exporter.get_finished_spans()))
    ttft = float(r.headers[TTFT_HEADER])
    assert ttft == pytest.approx(root.attributes[rs.TTFT], abs=1e-6) and ttft > 0
    assert ttft * 1e9 <= root.end_time - root.start_time  # decode came after it
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
    )
    responses = await client.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    )
    for answer in (chat, responses):
        assert answer.status_code == 200, answer.text
        assert 0 < float(answer.headers[TTFT_HEADER]) < 60
    assert TTFT_HEADER not in (await complete(client, stream=True)).headers
