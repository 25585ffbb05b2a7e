"""`response_format` and `tools` / `tool_choice`: their shapes, and the JSON schema each one
constrains generation to.

Schemas are checked against the JSON Schema meta-schema here (so the gateway refuses a broken
schema exactly as a replica would); the engine then compiles them, and refuses with a 400 what
its grammar compiler cannot express.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import Field, model_validator

from fleet_base.openai_contract.base import Strict
from fleet_base.sampling_params import StructuredOutput

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 * 1024
ToolMode = Literal["none", "auto", "required", "named"]


def check_schema(schema: Any, where: str) -> str:
    """The schema as compact JSON, or a ValueError naming what is wrong with it."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{where} is larger than {MAX_SCHEMA_BYTES} bytes")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        at = "/".join(str(p) for p in err.absolute_path)
        raise ValueError(
            f"{where} is not a valid JSON Schema{f' at {at!r}' if at else ''}: {err.message}"
        ) from None
    return text


class JsonSchemaSpec(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _valid_schema(self) -> JsonSchemaSpec:
        check_schema(self.schema_, "response_format.json_schema.schema")
        return self


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput(kind="json_object")
        if self.type == "json_schema":
            assert self.json_schema is not None
            # property order is kept: the grammar generates properties in the schema's order
            text = json.dumps(self.json_schema.schema_, separators=(",", ":"))
            return StructuredOutput(kind="json_schema", json_schema=text)
        return None


class FunctionDef(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _valid_parameters(self) -> FunctionDef:
        if self.parameters is not None:
            check_schema(self.parameters, f"the parameters of tool {self.name!r}")
        return self

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_mode(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolMode:
    """What tools do to this request: nothing, parsed if the model calls one, or forced."""
    if not tools or choice == "none":
        return "none"
    if isinstance(choice, NamedToolChoice):
        return "named"
    return "required" if choice == "required" else "auto"


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    if tools is not None and len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            known = ", ".join(repr(n) for n in names) or "none"
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r}, which is not among the "
                f"tools (given: {known})"
            )
    elif choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs at least one tool in 'tools'")


def _call_schema(fn: FunctionDef) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": fn.parameters_schema},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_constraint(
    tools: list[Tool], choice: ToolChoice | None, parallel: bool | None
) -> StructuredOutput | None:
    """The grammar of a forced call: a named tool's arguments object, or for 'required' a
    JSON array of {"name", "arguments"} calls (one call when parallel_tool_calls is false)."""
    mode = tool_mode(tools, choice)
    if mode == "named":
        assert isinstance(choice, NamedToolChoice)
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        schema = fn.parameters_schema
    elif mode == "required":
        options = [_call_schema(t.function) for t in tools]
        schema = {
            "type": "array",
            "minItems": 1,
            "items": options[0] if len(options) == 1 else {"anyOf": options},
        }
        if parallel is False:
            schema["maxItems"] = 1
    else:
        return None
    return StructuredOutput(kind="json_schema", json_schema=json.dumps(schema, separators=(",", ":")))
