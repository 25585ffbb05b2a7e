"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + j."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from engine.server.chat import SSE_HEADERS
from engine.server.continuation import TokenIdsOut
from engine.server.formatting import SSE_DONE, completion_logprobs, sse, sse_error, visible_logprobs
from engine.server.generation import Generation, check_context, generate
from engine.server.inputs import check_model, completion_prompt_ids, parse_body, sampling_params
from engine.server.state import ServerState
from fleet_base.openai_contract.requests import CompletionRequest


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, CompletionRequest)
    lora = check_model(state, body.model)
    engine = state.engine
    assert engine is not None
    state.metrics.api_request("completions", "text")
    params = sampling_params(body.sampling_params)
    prompts = completion_prompt_ids(engine, body.prompts())
    for ids in prompts:
        check_context(engine, len(ids), params.max_tokens, "prompt")

    gen, head = await generate(request, state, body, prompts, params, lora, "cmpl", "prompt")
    if body.stream:
        return StreamingResponse(
            _stream(gen, body, head, TokenIdsOut.wanted(request, gen)),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    choices = []
    for (i, j), st in sorted(gen.choices.items()):
        o = st.latest
        lps = None
        if body.logprobs is not None:
            lps, _ = completion_logprobs(visible_logprobs(o, st.all_logprobs()))
        choices.append(
            {
                "index": gen.choice_index(i, j),
                "text": o.text,
                "logprobs": lps,
                "finish_reason": o.finish_reason,
            }
        )
    return JSONResponse(
        {**head, "object": "text_completion", "choices": choices, "usage": gen.usage()},
        headers=gen.timing_headers(),
    )


async def _stream(
    gen: Generation, body: CompletionRequest, head: dict[str, Any], ids: TokenIdsOut | None
) -> AsyncIterator[str]:
    base = {**head, "object": "text_completion"}
    offsets: dict[tuple[int, int], int] = {}
    try:
        async for i, out in gen.outputs():
            for o in out.outputs:
                key = (i, o.index)
                st = gen.choices[key]
                if st.finish_sent:
                    continue
                steps = visible_logprobs(o, o.delta_logprobs) if body.logprobs is not None else []
                if not o.delta_text and not steps and not o.finished:
                    continue
                st.finish_sent = o.finished
                lps = None
                if body.logprobs is not None:
                    lps, offsets[key] = completion_logprobs(steps, offsets.get(key, 0))
                payload: dict[str, Any] = {
                    **base,
                    "choices": [
                        {
                            "index": gen.choice_index(i, o.index),
                            "text": o.delta_text,
                            "logprobs": lps,
                            "finish_reason": o.finish_reason,
                        }
                    ],
                }
                if ids is not None:
                    ids.attach(payload["choices"][0], key)
                if body.include_usage:
                    payload["usage"] = None
                yield sse(payload)
        if body.include_usage:
            yield sse({**base, "choices": [], "usage": gen.usage()})
        yield SSE_DONE
    except Exception as err:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(err)
    finally:
        gen.close()
