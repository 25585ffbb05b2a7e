"""vLLM's LoRA API: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, adapters in
`/v1/models` (with `parent` = the base) and requested as `"model": NAME`.

A load that cannot succeed (bad path, rank or targets that do not fit the base, a taken name)
is a 400 and changes nothing. `lora_path` may be a local directory or a model URI (s3://,
hf://, oci://, https://), pulled into the node's verified model cache first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from engine.server.errors import APIError
from engine.server.inputs import parse_body
from engine.server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM accepts (and ignores) more fields

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = Field(min_length=1, max_length=256)


def adapter_dir(path: str) -> Path:
    """A local adapter directory for a path or a model URI (pulled into the model cache)."""
    from fleet_base.models import ModelCache, ModelStoreError, is_remote

    if not is_remote(path):
        return Path(path).expanduser()
    cache = ModelCache()
    try:
        entry = cache.lookup(path) or cache.pull(path, in_use=[path]).entry
    except ModelStoreError as err:
        raise APIError(400, f"Could not fetch the adapter {path!r}: {err}", param="lora_path") from None
    cache.touch(entry)
    return cache.model_dir(entry)


def _lora(state: ServerState) -> Any:
    engine = state.engine
    if engine is None:
        raise APIError(503, "The model is still loading; retry shortly")
    if getattr(engine, "lora", None) is None:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    return engine


async def load_adapter(state: ServerState, name: str, path: str) -> Any:
    """Load one adapter (start-up and the API share it); APIError 400 when it cannot be."""
    from engine.lora import LoRAAdapterError

    engine = _lora(state)
    local = await asyncio.to_thread(adapter_dir, path)
    try:
        adapter = await engine.add_lora(name, str(local))
    except LoRAAdapterError as err:
        raise APIError(400, f"Cannot load LoRA adapter {name!r}: {err}", param="lora_path") from None
    state.lora_sources[name] = path
    state.metrics.lora_loaded(adapter.load_seconds, len(engine.list_loras()))
    return adapter


def adapter_cards(state: ServerState, created: int, max_model_len: int) -> list[dict[str, Any]]:
    engine = state.engine
    if engine is None or getattr(engine, "lora", None) is None:
        return []
    return [
        {
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": "fleet",
            "root": state.lora_sources.get(a.name, a.path),
            "parent": state.settings.served_model_name,
            "max_model_len": max_model_len,
        }
        for a in engine.list_loras()
    ]


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, LoadLoRAAdapterRequest)
        await load_adapter(state, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        engine = _lora(state)
        if engine.remove_lora(body.lora_name) is None:
            raise APIError(
                404, f"The LoRA adapter '{body.lora_name}' is not loaded", param="lora_name", code="not_found"
            )
        state.lora_sources.pop(body.lora_name, None)
        state.metrics.lora_unloaded(len(engine.list_loras()))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
