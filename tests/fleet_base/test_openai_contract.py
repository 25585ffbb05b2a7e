"""The shared OpenAI contract: request shapes and the 400s both engine and gateway give."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from agent.gateway.contract import check_body
from agent.gateway.errors import GatewayError
from fleet_base.openai_contract.embeddings import EmbeddingRequest
from fleet_base.openai_contract.errors import OpenAIError, validation_error
from fleet_base.openai_contract.requests import ChatCompletionRequest
from fleet_base.openai_contract.responses import ResponsesRequest

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(**extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def refusal(raw: bytes, model: type = ChatCompletionRequest) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate_json(raw)
    return validation_error(list(info.value.errors(include_url=False)))


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format.json_schema",
            "not a valid JSON Schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"tools": {"a": 1}}, "tools", "valid array"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [TOOL, TOOL]}, "tools", "unique"),
    ],
)
def test_chat_refusals_name_the_problem(extra: dict, param: str, says: str) -> None:
    raw = chat(**extra)
    err = refusal(raw)
    assert err.status == 400 and says in err.message
    assert err.param == param
    with pytest.raises(GatewayError) as gw:  # the gateway refuses it with the same words
        check_body(raw, "chat")
    assert gw.value.body() == err.body()


def test_tool_modes_and_constraints() -> None:
    auto = ChatCompletionRequest.model_validate_json(chat(tools=[TOOL]))
    assert auto.tool_mode == "auto" and auto.structured_output() is None and auto.feature == "tools_auto"
    named = ChatCompletionRequest.model_validate_json(
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    forced = named.structured_output()
    assert forced is not None and json.loads(forced.json_schema or "")["properties"]["city"] == {
        "type": "string"
    }
    none = ChatCompletionRequest.model_validate_json(chat(tools=[TOOL], tool_choice="none"))
    assert none.tool_mode == "none" and none.template_tools() is None
    fmt = ChatCompletionRequest.model_validate_json(chat(response_format={"type": "json_object"}))
    assert fmt.sampling_params().structured is not None and fmt.feature == "json_object"


@pytest.mark.parametrize("value", ["", [], [""], [[]], [1, "a"], {"a": 1}])
def test_embedding_input_must_be_something(value: object) -> None:
    raw = json.dumps({"model": "m", "input": value}).encode()
    err = refusal(raw, EmbeddingRequest)
    assert err.status == 400 and err.param == "input"
    with pytest.raises(GatewayError):
        check_body(raw, "embeddings")


def test_embedding_inputs_shapes() -> None:
    def inputs(v: object) -> list:
        return EmbeddingRequest.model_validate_json(json.dumps({"model": "m", "input": v})).inputs()

    assert inputs("a") == ["a"] and inputs(["a", "b"]) == ["a", "b"]
    assert inputs([1, 2]) == [[1, 2]] and inputs([[1], [2, 3]]) == [[1], [2, 3]]


def test_responses_translate_onto_chat() -> None:
    body = ResponsesRequest.model_validate_json(
        json.dumps(
            {
                "model": "m",
                "instructions": "be brief",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                ],
                "max_output_tokens": 7,
                "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
                "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "get_weather"},
                "cache_salt": "tenant-a",
            }
        )
    )
    chat_req = body.chat_request()
    roles = [m.role for m in chat_req.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert chat_req.messages[2].tool_calls and chat_req.messages[3].tool_call_id == "c1"
    assert chat_req.requested_max_tokens == 7 and chat_req.tool_mode == "named"
    assert chat_req.cache_salt == "tenant-a"  # the gateway's per-tenant salt reaches the engine


def test_previous_response_id_is_a_clear_400() -> None:
    raw = json.dumps({"model": "m", "input": "hi", "previous_response_id": "resp_1"}).encode()
    err = refusal(raw, ResponsesRequest)
    assert err.status == 400 and "does not store responses" in err.message
