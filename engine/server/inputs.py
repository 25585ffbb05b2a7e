"""From an HTTP body to engine inputs: size-limited read, strict parse, model check,
sampling parameters and prompt token ids. Every failure is an APIError with a 4xx status."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from engine.server.errors import APIError, validation_error
from engine.server.state import EngineClient, ServerState
from fleet_base.openai_contract.requests import ChatMessage
from fleet_base.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    try:
        body = await request.body()
    except ClientDisconnect:  # gone, or cut off by the listener's body deadline
        raise APIError(408, "The request body was not received in time", code="request_timeout") from None
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise validation_error(list(err.errors(include_url=False))) from None


def check_model(state: ServerState, name: str | None) -> str | None:
    """None for the base model; the adapter's name when `name` is a loaded LoRA adapter."""
    served = state.settings.served_model_name
    if name is None or name == served:
        return None
    manager = getattr(state.engine, "lora", None)
    if manager is not None and manager.get(name) is not None:
        return name
    raise APIError(
        404,
        f"The model '{name}' does not exist on this server; it serves '{served}' (see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def sampling_params(build: Any) -> SamplingParams:
    """Builds SamplingParams, turning its own validation failures into 400s."""
    try:
        return build()
    except ValidationError as err:
        raise validation_error(list(err.errors(include_url=False))) from None
    except ValueError as err:
        raise APIError(400, str(err)) from None


def chat_prompt_ids(
    engine: EngineClient,
    messages: list[ChatMessage] | list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
) -> list[int]:
    plain = [m.to_template() if isinstance(m, ChatMessage) else m for m in messages]
    try:
        return list(
            engine.tokenizer.encode_chat(plain, add_generation_prompt=add_generation_prompt, tools=tools)
        )
    except ValueError as err:  # ChatTemplateError is a ValueError
        raise APIError(400, f"Could not apply the chat template: {err}", param="messages") from None


def check_token_ids(engine: EngineClient, ids: list[int], param: str) -> None:
    vocab = int(engine.model_config.vocab_size)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {vocab})", param=param)


def completion_prompt_ids(
    engine: EngineClient, prompts: list[str | list[int]], param: str = "prompt"
) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(engine.tokenizer.encode_batch(texts) if texts else [])
    out: list[list[int]] = []
    for p in prompts:
        ids = next(encoded) if isinstance(p, str) else list(p)
        if isinstance(p, list):
            check_token_ids(engine, ids, param)
        if not ids:
            raise APIError(400, f"The {param} is empty: give at least one token of text", param=param)
        out.append(ids)
    return out
