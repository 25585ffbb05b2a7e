"""What a deployment's engine cannot answer, refused before routing.

A request the replica would refuse (a generative vLLM model asked for embeddings, a JSON
schema where the engine has no structured outputs, a prompt of token ids) would otherwise
get the replica's 404/501, be retried on the next replica and reach the client as a 5xx.
`refusal` says so up front, from the deployment's engine (fleet_base.engines) and the
request; the gateway answers it as an OpenAI-shaped 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.gateway.errors import GatewayError
from fleet_base.engines import CAPABILITIES, EngineKind, serves_embeddings

CODE = "unsupported_by_engine"
_SCHEMA_FORMATS = ("json_schema", "json_object")


def refusal(
    deployment: str,
    kind: EngineKind,
    engine_args: Mapping[str, object],
    endpoint: str,
    body: Mapping[str, Any],
) -> GatewayError | None:
    """The 400 for a request `kind` cannot serve on this deployment; None when it can."""
    caps = CAPABILITIES[kind]
    runs = f"deployment {deployment!r} runs engine {kind}, which does not serve"
    if endpoint == "embeddings":
        if not serves_embeddings(kind, engine_args):
            return GatewayError(400, f"{runs} embeddings", param="model", code=CODE)
        if not caps.prompt_token_ids and _token_ids(body.get("input")):
            return GatewayError(400, f"{runs} token-id inputs", param="input", code=CODE)
        return None
    if not caps.structured_outputs:
        param = _schema_param(endpoint, body)
        if param is not None:
            return GatewayError(400, f"{runs} structured outputs ({param})", param=param, code=CODE)
    if endpoint == "completions" and not caps.prompt_token_ids and _token_ids(body.get("prompt")):
        return GatewayError(400, f"{runs} token-id prompts", param="prompt", code=CODE)
    return None


def _schema_param(endpoint: str, body: Mapping[str, Any]) -> str | None:
    """The field that asks for schema-constrained output, if any: `response_format` (chat,
    completions) or the Responses API's `text.format`."""
    if endpoint == "responses":
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, Mapping) else None
        return "text.format" if isinstance(fmt, Mapping) and fmt.get("type") in _SCHEMA_FORMATS else None
    fmt = body.get("response_format")
    return "response_format" if isinstance(fmt, Mapping) and fmt.get("type") in _SCHEMA_FORMATS else None


def _token_ids(prompt: object) -> bool:
    """A prompt (or one of a batch) given as token ids."""
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return True
    return any(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt)
