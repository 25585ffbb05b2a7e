"""The OpenAPI document of the OpenAI-compatible surface, built from the request models
(the handlers read their bodies themselves, so FastAPI cannot see them). Served by the
engine and by the gateway at /openapi.json; API fuzzers (schemathesis) are driven by it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from fleet_base.openai_contract.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _responses(ok: str) -> dict[str, Any]:
    error = {"description": "OpenAI error shape", "content": {"application/json": {"schema": _ERROR}}}
    return {"200": {"description": ok}, "4XX": error, "5XX": error}


def openapi_document(title: str, *, tokenize: bool = True, bearer: bool = False) -> dict[str, Any]:
    """The document; `tokenize` adds /tokenize and /detokenize (the engine's, not the
    gateway's); `bearer` marks the inference routes as needing a bearer key."""
    models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest]
    if tokenize:
        models += [TokenizeRequest, DetokenizeRequest]
    refs, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas = dict(top.get("$defs", {}))
    security = [{"bearer": []}] if bearer else []

    def post(model: type[BaseModel], op: str, ok: str) -> dict[str, Any]:
        body = {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        return {
            "post": {
                "operationId": op,
                "requestBody": body,
                "responses": _responses(ok),
                "security": security,
            }
        }

    paths: dict[str, Any] = {
        "/v1/completions": post(CompletionRequest, "createCompletion", "a completion, or an SSE stream"),
        "/v1/chat/completions": post(ChatCompletionRequest, "createChatCompletion", "a chat completion"),
        "/v1/models": {"get": {"operationId": "listModels", "responses": _responses("the models")}},
        "/health": {"get": {"operationId": "health", "responses": _responses("healthy"), "security": []}},
    }
    if tokenize:
        paths["/tokenize"] = post(TokenizeRequest, "tokenize", "token ids")
        paths["/detokenize"] = post(DetokenizeRequest, "detokenize", "text")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if bearer:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
