"""The gateway's use of the OpenAI contract (`fleet_base.openai_contract`, torch-free).

Every body is validated by the very models the replica validates with, so a bad request is
refused here with the replica's own 400, before it takes a quota, a queue slot or a replica.
Also what routing and accounting need of the endpoints beyond chat and completions: the
prompt an embeddings or Responses request carries, and its usage in the chat form the
quota and usage records count.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from agent.gateway.errors import GatewayError
from fleet_base.openai_contract.embeddings import EmbeddingRequest
from fleet_base.openai_contract.errors import validation_error
from fleet_base.openai_contract.requests import ChatCompletionRequest, CompletionRequest
from fleet_base.openai_contract.responses import ResponsesRequest

MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "embeddings": EmbeddingRequest,
    "responses": ResponsesRequest,
}


class Counter(Protocol):
    def count(self, text: str) -> int: ...


def check_body(raw: bytes, endpoint: str) -> BaseModel:
    """The parsed request, or the replica's 400 for it as a GatewayError."""
    try:
        parsed = MODELS[endpoint].model_validate_json(raw)
        if isinstance(parsed, ResponsesRequest):
            parsed.chat_request()  # what the replica will run must be valid too
        return parsed
    except ValidationError as err:
        e = validation_error(list(err.errors(include_url=False)))
        raise GatewayError(e.status, e.message, param=e.param, code=e.code) from None


def embedding_prompts(body: dict[str, Any], counter: Counter) -> tuple[int, int]:
    """(estimated prompt tokens, number of inputs) of a valid embeddings body."""
    value = body.get("input")
    if isinstance(value, str):
        return counter.count(value), 1
    assert isinstance(value, list) and value
    if all(isinstance(x, str) for x in value):
        return sum(counter.count(x) for x in value), len(value)
    if all(isinstance(x, int) for x in value):
        return len(value), 1
    return sum(len(x) for x in value), len(value)


def responses_prompt_tokens(body: dict[str, Any], counter: Counter) -> int:
    text = [body.get("instructions") or ""]
    value = body.get("input")
    if isinstance(value, str):
        text.append(value)
    for item in value if isinstance(value, list) else []:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, str):
            text.append(content)
        elif isinstance(content, list):
            text += [p.get("text", "") for p in content if isinstance(p, dict)]
        for key in ("arguments", "output"):
            if isinstance(item, dict) and isinstance(item.get(key), str):
                text.append(item[key])
    return sum(counter.count(t) for t in text if t) + 4 * (len(value) if isinstance(value, list) else 1)


def accounting_usage(endpoint: str, usage: dict[str, Any]) -> dict[str, Any]:
    """Usage as prompt_tokens / completion_tokens, whatever the endpoint calls them."""
    if endpoint == "responses" and "input_tokens" in usage:
        return {
            "prompt_tokens": usage.get("input_tokens"),
            "completion_tokens": usage.get("output_tokens"),
            "total_tokens": usage.get("total_tokens"),
        }
    if endpoint == "embeddings" and "completion_tokens" not in usage:
        return {**usage, "completion_tokens": 0}
    return usage
