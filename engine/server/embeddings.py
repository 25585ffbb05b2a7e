"""POST /v1/embeddings: one engine request per input, pooled from the last hidden state.

Inputs go through the same scheduler as generation (prefill only, no sampling); pooling
(mean or last token) and normalization are server settings. `dimensions` is accepted only
at the model's own width: these models are not trained to be truncated (Matryoshka).
"""

from __future__ import annotations

import base64
import struct
import uuid

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from engine.server.errors import APIError
from engine.server.generation import Generation, check_context
from engine.server.inputs import check_model, completion_prompt_ids, parse_body
from engine.server.state import ServerState
from fleet_base.openai_contract.embeddings import EmbeddingRequest
from fleet_base.sampling_params import PoolingParams, SamplingParams


def encode_embedding(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


async def create_embedding(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, EmbeddingRequest)
    if check_model(state, body.model) is not None:
        raise APIError(400, "Embeddings are served by the base model, not a LoRA adapter", param="model")
    engine = state.engine
    assert engine is not None
    width = int(engine.model_config.hidden_size)
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(
            400,
            f"This model's embeddings have {width} dimensions and it does not support shortened "
            f"embeddings; omit 'dimensions' or set it to {width}",
            param="dimensions",
        )
    state.metrics.api_request("embeddings", "embedding")
    prompts = completion_prompt_ids(engine, body.inputs(), "input")
    for ids in prompts:
        check_context(engine, len(ids), 1, "input")
    settings = state.settings
    pooling = PoolingParams(pooling=settings.embedding_pooling, normalize=settings.embedding_normalize)
    gen = Generation(
        state, prompts, SamplingParams(max_tokens=1, pooling=pooling), f"embd-{uuid.uuid4().hex}", "input"
    )
    await gen.run(request, stream=False)
    data = []
    for i, out in enumerate(gen.final):
        if out is None or out.embedding is None:
            raise APIError(503, "The engine stopped before the embedding was computed; retry the request")
        data.append(
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_embedding(out.embedding, body.encoding_format),
            }
        )
    tokens = sum(len(p) for p in prompts)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": settings.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
