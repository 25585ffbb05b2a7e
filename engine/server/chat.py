"""POST /v1/chat/completions: the chat template, then one engine request with `n` sequences."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from engine.server.formatting import SSE_DONE, TokenBytes, chat_logprobs, sse, sse_error, visible_logprobs
from engine.server.generation import Generation, check_context
from engine.server.inputs import chat_prompt_ids, check_model, parse_body, sampling_params
from engine.openai_contract.requests import ChatCompletionRequest
from engine.server.state import ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    check_model(state, body.model)
    engine = state.engine
    assert engine is not None
    params = sampling_params(body.sampling_params)
    ids = chat_prompt_ids(engine, body.messages, body.tools, body.add_generation_prompt)
    check_context(engine, len(ids), params.max_tokens, "messages")

    created = int(time.time())
    gen = Generation(
        state, [ids], params, f"chatcmpl-{uuid.uuid4().hex}", "messages", cache_salt=body.cache_salt
    )
    await gen.run(request, stream=body.stream)
    head = {"id": gen.request_id, "created": created, "model": state.settings.served_model_name}
    token_bytes = TokenBytes(engine.tokenizer)
    if body.stream:
        return StreamingResponse(
            _stream(gen, body, head, token_bytes), media_type="text/event-stream", headers=SSE_HEADERS
        )
    choices = []
    for (_, j), st in sorted(gen.choices.items()):
        o = st.latest
        lps = chat_logprobs(visible_logprobs(o, st.all_logprobs()), token_bytes) if body.logprobs else None
        choices.append(
            {
                "index": j,
                "message": {"role": "assistant", "content": o.text, "refusal": None},
                "logprobs": lps,
                "finish_reason": o.finish_reason,
            }
        )
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": gen.usage()})


async def _stream(
    gen: Generation, body: ChatCompletionRequest, head: dict[str, Any], token_bytes: TokenBytes
) -> AsyncIterator[str]:
    base = {**head, "object": "chat.completion.chunk"}
    include_usage = body.include_usage

    def chunk(choice: dict[str, Any]) -> str:
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    try:
        for j in range(gen.params.n):
            yield chunk(
                {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        async for i, out in gen.outputs():
            for o in out.outputs:
                st = gen.choices[(i, o.index)]
                if st.finish_sent:
                    continue
                steps = visible_logprobs(o, o.delta_logprobs) if body.logprobs else []
                if not o.delta_text and not steps and not o.finished:
                    continue
                st.finish_sent = o.finished
                yield chunk(
                    {
                        "index": o.index,
                        "delta": {"content": o.delta_text} if o.delta_text or not o.finished else {},
                        "logprobs": chat_logprobs(steps, token_bytes) if body.logprobs else None,
                        "finish_reason": o.finish_reason,
                    }
                )
        if include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage()})
        yield SSE_DONE
    except Exception as err:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(err)
    finally:
        gen.close()
