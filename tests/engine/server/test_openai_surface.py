"""The OpenAI surface beyond text, with the openai SDK against the real SmolLM2 replica and
through a real gateway in front of it: structured outputs, tool calls, embeddings and the
Responses API. Generations are short (small max_tokens, bounded schemas): the machine is shared."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from control_plane.local.nats_server import NatsServer
from engine.server.process import ServerProcess
from fleet_base.api_keys import Quotas
from tests.agent.gateway.harness import GatewayProcess, make_key, peer, replica, route, sample, scrape
from tests.engine.server.conftest import MODEL, metric
from tests.engine.server.conftest import scrape as scrape_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog", "none"]},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "likes_tea"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def gateway(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, dict[str, str]]]:
    work = tmp_path_factory.mktemp("surface-gw")
    nats = NatsServer(work / "nats").start()
    gw = GatewayProcess(work / "gw", "east", nats_url=nats.url)
    try:
        gw.start()
        secrets, records = {}, []
        for name, quotas in (("main", Quotas()), ("tiny", Quotas(tokens_per_minute=5))):
            secret, record = make_key(name)
            secrets[name] = secret
            records.append(record.model_copy(update={"quotas": quotas}))
        gw.write(
            replicas=[replica("r1", server.url, deployment=MODEL)],
            keys=records,
            routes=[route(MODEL, [peer("east", gw.url, 0.0, 0.0)])],
        )
        yield gw, secrets
    finally:
        gw.stop()
        nats.stop()


@pytest.fixture(scope="module")
def engine_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=900)


@pytest.fixture(scope="module")
def client(gateway: tuple[GatewayProcess, dict[str, str]]) -> openai.OpenAI:
    gw, secrets = gateway
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secrets["main"], max_retries=0, timeout=900)


def test_json_schema_strict_conforms_at_temperature_07_through_the_gateway(client: openai.OpenAI) -> None:
    prompts = [f"Describe {who} as JSON." for who in ("a pirate", "my aunt", "a robot", "a chef")]

    def ask(prompt: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0.7,
            max_tokens=64,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )

    with ThreadPoolExecutor(len(prompts)) as pool:  # batched in the engine
        results = list(pool.map(ask, prompts))
    for r in results:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a pet."}],
        response_format=Pet,
        temperature=0,
        max_tokens=64,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_json_object_streamed_is_an_object(engine_client: openai.OpenAI) -> None:
    stream = engine_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a key 'a'."}],
        response_format={"type": "json_object"},
        max_tokens=24,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("{")  # the whole object when it ends before max_tokens
    if text.rstrip().endswith("}"):
        assert isinstance(json.loads(text), dict)


def _check_call(call: object, name: str, schema: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_named_and_required_tool_calls_conform(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_call(choice.message.tool_calls[0], "get_weather", WEATHER["function"]["parameters"])

    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        max_tokens=48,
    )  # fmt: skip
    (call,) = required.choices[0].message.tool_calls
    fn = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]
    _check_call(call, fn["name"], fn["parameters"])
    assert required.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_calls_assemble_in_the_sdk(client: openai.OpenAI) -> None:
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        with client.beta.chat.completions.stream(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=48,
        ) as stream:
            final = stream.get_final_completion()
        (call,) = final.choices[0].message.tool_calls
        _check_call(call, "get_weather", WEATHER["function"]["parameters"])
        assert final.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_turn(client: openai.OpenAI) -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 60  # the tool list, the call and its result are all in the prompt


def test_embeddings_float_base64_batched_deterministic(client: openai.OpenAI, server: ServerProcess) -> None:
    texts = ["the cat sat on the mat", "a dog ran in the park", "the cat sat on the mat"]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.usage.prompt_tokens > 0
    vecs = [d.embedding for d in floats.data]
    assert len(vecs[0]) == 576 and abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-4

    def gap(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b))

    assert gap(vecs[0], vecs[2]) < 1e-5 and gap(vecs[0], vecs[1]) > 1e-3
    # the SDK asks for base64 by default and decodes it; the same input gives the same vector
    default = client.embeddings.create(model=MODEL, input=texts[0])
    assert gap(default.data[0].embedding, vecs[0]) < 1e-5
    raw = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": MODEL, "input": [[1, 2, 3]], "encoding_format": "base64"},
        timeout=300,
    ).json()
    assert len(struct.unpack("<576f", base64.b64decode(raw["data"][0]["embedding"]))) == 576
    assert raw["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_embeddings_count_prompt_tokens_in_quotas(gateway: tuple[GatewayProcess, dict[str, str]]) -> None:
    gw, secrets = gateway
    before = sample(scrape(gw.url), "fleet_gateway_tokens_total", deployment=MODEL, kind="prompt")
    tiny = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secrets["tiny"], max_retries=0)
    with pytest.raises(openai.RateLimitError):  # 5 tokens per minute: a long input does not fit
        tiny.embeddings.create(model=MODEL, input="one two three four five six seven eight nine ten")
    main = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=secrets["main"], max_retries=0)
    used = main.embeddings.create(model=MODEL, input="count me").usage.prompt_tokens
    after = sample(scrape(gw.url), "fleet_gateway_tokens_total", deployment=MODEL, kind="prompt")
    assert after - before == used


def test_responses_text_and_stream_events(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8
    )
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 8
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        kinds[-1],
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output[0].content[0].text == deltas


def test_responses_json_schema_and_function_tool(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="A person, please.", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), PERSON)
    fn = WEATHER["function"]
    r = client.responses.create(
        model=MODEL, input="Weather in Oslo?", max_output_tokens=32, tool_choice={"type": "function", "name": fn["name"]},
        tools=[{"type": "function", "name": fn["name"], "parameters": fn["parameters"], "strict": True}],
    )  # fmt: skip
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])


BAD = [
    ("/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema"),
    ("/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}}, "response_format"),
    ("/chat/completions", {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/chat/completions", {"messages": ASK, "tools": {"get_weather": WEATHER}}, "tools"),
    ("/embeddings", {"input": []}, "input"),
    ("/embeddings", {"input": ""}, "input"),
    ("/embeddings", {"input": "a", "dimensions": 8}, "dimensions"),
    ("/responses", {"input": "hi", "previous_response_id": "resp_1"}, None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_is_a_400_in_the_error_shape_at_both(
    path: str,
    body: dict,
    param: str | None,
    server: ServerProcess,
    gateway: tuple[GatewayProcess, dict[str, str]],
) -> None:
    gw, secrets = gateway
    answers = [
        httpx.post(f"{server.url}/v1{path}", json={"model": MODEL, **body}, timeout=60),
        httpx.post(f"{gw.url}/v1{path}", json={"model": MODEL, **body}, timeout=60,
                   headers={"authorization": f"Bearer {secrets['main']}"}),
    ]  # fmt: skip
    for r in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and err["message"]
    assert answers[0].json() == answers[1].json()


def test_metrics_per_feature_and_grammar_timings(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        samples = scrape_engine(http)
    assert metric(samples, "fleet_engine_api_requests_total", endpoint="chat", feature="json_schema") >= 1
    assert metric(samples, "fleet_engine_api_requests_total", endpoint="embeddings", feature="embedding") >= 1
    assert metric(samples, "fleet_engine_api_requests_total", endpoint="responses", feature="text") >= 1
    assert metric(samples, "fleet_engine_grammar_compile_seconds_count") >= 1
    assert metric(samples, "fleet_engine_grammar_mask_seconds_count") >= 1


def test_an_unknown_path_lists_the_new_endpoints(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/nothing", json={}, timeout=60)
    assert r.status_code == 404 and "/v1/embeddings" in r.json()["error"]["message"]
