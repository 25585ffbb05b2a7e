"""POST /v1/responses: the Responses API as a translation onto chat completions.

The request becomes a chat request (`ResponsesRequest.chat_request`), runs through the same
path as /v1/chat/completions, and its result or chunks are re-shaped into a Response object
or the documented event sequence: response.created, response.in_progress, then per output
item output_item.added -> (content_part.added -> output_text.delta* -> output_text.done ->
content_part.done | function_call_arguments.delta* -> function_call_arguments.done) ->
output_item.done, and finally response.completed (or response.incomplete). Stateless.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from engine.server.chat import SSE_HEADERS, ChatRun, chat_chunks, chat_result, run_chat
from engine.server.formatting import sse_error
from engine.server.inputs import parse_body
from engine.server.state import ServerState
from fleet_base.openai_contract.errors import validation_error
from fleet_base.openai_contract.responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _text_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


class _Shape:
    """The Response object's fields that echo the request."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body = body
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = model

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, finish: str | None
    ) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": b.temperature if b.temperature is not None else 1.0,
            "top_p": b.top_p if b.top_p is not None else 1.0,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "tool_choice": _tool_choice(b),
            "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in b.tools or []],
            "truncation": "disabled",
            "usage": usage,
            "metadata": b.metadata or {},
            "user": b.user,
        }


def _tool_choice(b: ResponsesRequest) -> Any:
    c = b.tool_choice
    if c is None:
        return "auto"
    return c if isinstance(c, str) else {"type": "function", "name": c.name}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def create_response(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, ResponsesRequest)
    try:
        chat = body.chat_request()
    except ValidationError as err:
        raise validation_error(list(err.errors(include_url=False))) from None
    run = await run_chat(request, state, chat, "responses")
    shape = _Shape(body, state.settings.served_model_name)
    if body.stream:
        return StreamingResponse(_events(run, shape), media_type="text/event-stream", headers=SSE_HEADERS)
    result = chat_result(run)
    choice = result["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append(_text_item(_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        output.append(_call_item(_id("fc"), call["id"], fn["name"], fn["arguments"]))
    finish = choice["finish_reason"]
    return JSONResponse(
        shape.response(_status(finish), output, _usage(result["usage"]), finish),
        headers=run.gen.timing_headers(),
    )


def _event(kind: str, seq: int, **fields: Any) -> str:
    payload = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(run: ChatRun, shape: _Shape) -> AsyncIterator[str]:  # noqa: C901 - the Responses event order is one state machine
    seq = 0
    output: list[dict[str, Any]] = []
    text_open: dict[str, Any] | None = None  # {"id", "index", "text"}
    calls: dict[int, dict[str, Any]] = {}  # tool call index -> {"item", "index"}
    usage: dict[str, Any] | None = None
    finish: str | None = None

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        out = _event(kind, seq, **fields)
        seq += 1
        return out

    def close_text() -> list[str]:
        nonlocal text_open
        if text_open is None:
            return []
        t, text_open = text_open, None
        part = {"type": "output_text", "text": t["text"], "annotations": []}
        item = _text_item(t["id"], t["text"])
        output[t["index"]] = item
        common = {"item_id": t["id"], "output_index": t["index"], "content_index": 0}
        return [
            ev("response.output_text.done", **common, text=t["text"]),
            ev("response.content_part.done", **common, part=part),
            ev("response.output_item.done", output_index=t["index"], item=item),
        ]

    def close_calls() -> list[str]:
        out = []
        for c in calls.values():
            item = c["item"]
            item["status"] = "completed"
            output[c["index"]] = dict(item)
            out.append(
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=c["index"],
                    arguments=item["arguments"],
                )
            )
            out.append(ev("response.output_item.done", output_index=c["index"], item=dict(item)))
        calls.clear()
        return out

    try:
        yield ev("response.created", response=shape.response("in_progress", [], None, None))
        yield ev("response.in_progress", response=shape.response("in_progress", [], None, None))
        async for chunk in chat_chunks(run):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                text = delta.get("content")
                if text:
                    if text_open is None:
                        text_open = {"id": _id("msg"), "index": len(output), "text": ""}
                        output.append(_text_item(text_open["id"], "", "in_progress"))
                        yield ev(
                            "response.output_item.added", output_index=text_open["index"], item=output[-1]
                        )
                        yield ev(
                            "response.content_part.added",
                            item_id=text_open["id"],
                            output_index=text_open["index"],
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    text_open["text"] += text
                    yield ev(
                        "response.output_text.delta",
                        item_id=text_open["id"],
                        output_index=text_open["index"],
                        content_index=0,
                        delta=text,
                    )
                for tc in delta.get("tool_calls") or []:
                    for e in close_text():
                        yield e
                    fn = tc.get("function") or {}
                    k = tc.get("index", 0)
                    if k not in calls:
                        item = _call_item(
                            _id("fc"), tc.get("id") or _id("call"), fn.get("name", ""), "", "in_progress"
                        )
                        calls[k] = {"item": item, "index": len(output)}
                        output.append(dict(item))
                        yield ev(
                            "response.output_item.added", output_index=calls[k]["index"], item=dict(item)
                        )
                    piece = fn.get("arguments") or ""
                    if piece:
                        calls[k]["item"]["arguments"] += piece
                        yield ev(
                            "response.function_call_arguments.delta",
                            item_id=calls[k]["item"]["id"],
                            output_index=calls[k]["index"],
                            delta=piece,
                        )
        for e in close_text() + close_calls():
            yield e
        status = _status(finish)
        final = shape.response(status, output, _usage(usage), finish)
        yield ev(f"response.{status}", response=final)
    except Exception as err:  # headers are sent: report in-band
        yield sse_error(err)
    finally:
        run.gen.close()
