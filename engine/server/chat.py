"""POST /v1/chat/completions: the chat template, then one engine request with `n` sequences.

Structured outputs and forced tool calls arrive here as a grammar constraint in the sampling
params (the engine masks every token outside it); tool calls are assembled per choice by
`engine.tool_calls.output`. `run_chat` and `chat_chunks` are shared with /v1/responses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from engine.server.continuation import TokenIdsOut
from engine.server.formatting import SSE_DONE, TokenBytes, chat_logprobs, sse, sse_error, visible_logprobs
from engine.server.generation import Generation, check_context, generate
from engine.server.inputs import chat_prompt_ids, check_model, parse_body, sampling_params
from engine.server.state import ServerState
from engine.tool_calls.output import ChoiceOutput
from engine.tool_calls.parsers import parser_for_template
from engine.tool_calls.render import prepare
from fleet_base.openai_contract.requests import ChatCompletionRequest
from fleet_base.openai_contract.structured import NamedToolChoice

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its generation and how to shape its choices."""

    gen: Generation
    body: ChatCompletionRequest
    head: dict[str, Any]
    token_bytes: TokenBytes
    template: str | None
    token_ids: TokenIdsOut | None = None  # the gateway asked for each chunk's token ids

    def choice_output(self) -> ChoiceOutput:
        mode = self.body.tool_mode
        named = (
            self.body.tool_choice.function.name
            if isinstance(self.body.tool_choice, NamedToolChoice)
            else None
        )
        parser = parser_for_template(self.template) if mode == "auto" else None
        return ChoiceOutput(mode, parser, named, parallel=self.body.parallel_tool_calls is not False)


async def run_chat(
    request: Request, state: ServerState, body: ChatCompletionRequest, endpoint: str
) -> ChatRun:
    """Validate against the engine, render the prompt, submit (admission errors are 4xx here)."""
    lora = check_model(state, body.model)
    engine = state.engine
    assert engine is not None
    state.metrics.api_request(endpoint, body.feature)
    params = sampling_params(body.sampling_params)
    template = getattr(engine.tokenizer, "chat_template", None)
    messages, tools = prepare([m.to_template() for m in body.messages], body.template_tools(), template)
    ids = chat_prompt_ids(engine, messages, tools, body.add_generation_prompt)
    check_context(engine, len(ids), params.max_tokens, "messages")
    gen, head = await generate(request, state, body, [ids], params, lora, "chatcmpl", "messages")
    wanted = TokenIdsOut.wanted(request, gen) if body.stream else None
    return ChatRun(gen, body, head, TokenBytes(engine.tokenizer), template, wanted)


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    run = await run_chat(request, state, body, "chat")
    if body.stream:
        return StreamingResponse(_sse(run), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(chat_result(run), headers=run.gen.timing_headers())


def chat_result(run: ChatRun) -> dict[str, Any]:
    gen, body = run.gen, run.body
    choices = []
    for (_, j), st in sorted(gen.choices.items()):
        o = st.latest
        lps = (
            chat_logprobs(visible_logprobs(o, st.all_logprobs()), run.token_bytes) if body.logprobs else None
        )
        message, finish = run.choice_output().message(o.text, o.finish_reason)
        choices.append({"index": j, "message": message, "logprobs": lps, "finish_reason": finish})
    return {**run.head, "object": "chat.completion", "choices": choices, "usage": gen.usage()}


async def chat_chunks(run: ChatRun) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunks as data (the caller frames them); usage last when asked for."""
    gen, body = run.gen, run.body
    base = {**run.head, "object": "chat.completion.chunk"}
    include_usage = body.include_usage
    outputs = [run.choice_output() for _ in range(gen.params.n)]

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return payload

    for j in range(0 if gen.resume_token_ids else gen.params.n):  # a continuation: sent already
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
            shaper = outputs[o.index]
            deltas = shaper.feed(o.delta_text) if o.delta_text else []
            finish = None
            if o.finished:
                last, finish = shaper.finish(o.finish_reason)
                deltas += last
            lps = chat_logprobs(steps, run.token_bytes) if body.logprobs else None
            if not deltas and (lps is not None or o.finished):
                deltas = [{"content": ""} if not o.finished and shaper.mode == "none" else {}]
            for k, delta in enumerate(deltas):
                final = k == len(deltas) - 1
                choice = {
                    "index": o.index,
                    "delta": delta,
                    "logprobs": lps if k == 0 else None,
                    "finish_reason": finish if final else None,
                }
                if run.token_ids is not None and k == 0:
                    run.token_ids.attach(choice, (i, o.index))
                yield chunk(choice)
    if include_usage:
        yield {**base, "choices": [], "usage": gen.usage()}


async def _sse(run: ChatRun) -> AsyncIterator[str]:
    try:
        async for payload in chat_chunks(run):
            yield sse(payload)
        yield SSE_DONE
    except Exception as err:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(err)
    finally:
        run.gen.close()
