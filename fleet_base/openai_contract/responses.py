"""POST /v1/responses as a translation onto chat completions (stateless).

Input is a string or a list of items: messages (role + text content), earlier
`function_call` items and their `function_call_output`s. `instructions` become a system
message, `text.format` becomes `response_format`, flat function tools become chat tools.
Nothing is stored, so `previous_response_id` is refused with a 400 that says so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fleet_base.openai_contract.base import Strict
from fleet_base.openai_contract.requests import ChatCompletionRequest
from fleet_base.openai_contract.structured import NAME_PATTERN

_TEXT_PARTS = ("input_text", "output_text", "text")


class InputPart(Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> InputPart:
        if self.type not in _TEXT_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported; only text parts are")
        if self.text is None:
            raise ValueError(f"a content part of type {self.type!r} needs a 'text' string")
        return self


class InputItem(Strict):
    """A message, a function_call the model made earlier, or a function_call_output."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> InputItem:
        if self.type == "message" and (self.role is None or self.content is None):
            raise ValueError("a message item needs 'role' and 'content'")
        if self.type == "function_call" and (
            self.call_id is None or self.name is None or self.arguments is None
        ):
            raise ValueError("a function_call item needs 'call_id', 'name' and 'arguments'")
        if self.type == "function_call_output" and (self.call_id is None or self.output is None):
            raise ValueError("a function_call_output item needs 'call_id' and 'output'")
        return self

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text or "" for p in c or [])


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesRequest(Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # the prefix-cache salt the fleet gateway sets per tenant, passed on to the chat request
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        return v

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id is not supported: this server does not store responses; "
                "send the whole conversation as input items instead"
            )
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """The output bound; None: up to the context window, as for chat."""
        return self.max_output_tokens

    def chat_body(self) -> dict[str, Any]:
        """The equivalent /v1/chat/completions body (as JSON-ready data)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                if item.type == "message":
                    messages.append({"role": item.role, "content": item.text()})
                elif item.type == "function_call":
                    call = {
                        "id": item.call_id,
                        "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments},
                    }
                    last = messages[-1] if messages else None
                    if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                        last["tool_calls"].append(call)
                    else:
                        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                else:
                    messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "cache_salt": self.cache_salt,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name or "response", "schema": fmt.schema_ or {"type": "object"}}
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": t.model_dump(exclude={"type"}, exclude_none=True, by_alias=True),
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        return body

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request, validated by the same contract (raises ValidationError)."""
        return ChatCompletionRequest.model_validate_json(json.dumps(self.chat_body()))
