"""From a choice's generated text to an OpenAI assistant message: plain content, or
`tool_calls`, whole (non-streaming) or as the deltas the SDK assembles (streaming).

Modes (see `fleet_base.openai_contract.structured.tool_mode`):
- `none`: the text is the content.
- `named`: generation was constrained to the named function's arguments object, so the text
  *is* the arguments; streamed as argument deltas of call 0 as they arrive.
- `required`: constrained to a JSON array of `{"name", "arguments"}`; each call is sent once
  it is complete (at the end of the choice).
- `auto`: the model's own format, read by the template's parser; content streams until a
  call marker appears, text that could be the start of a marker is held back.

As vLLM does: `parallel_tool_calls: false` keeps only the first call. A choice cut by
max_tokens (`finish_reason: "length"`) returns the calls completed before the cut as
`tool_calls`, still with `"length"`; the cut call is dropped, never returned as content (a
`named` call's arguments are the cut text itself, as OpenAI returns them).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from engine.tool_calls.parsers import ParsedCall, ToolParser, json_array_items


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _calls_json(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def _required_calls(text: str, truncated: bool) -> list[ParsedCall] | None:
    items = json_array_items(text, truncated)
    if items is None or not all(isinstance(i, dict) and "name" in i for i in items):
        return None
    return [ParsedCall(str(i["name"]), json.dumps(i.get("arguments", {}), ensure_ascii=False)) for i in items]


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ChoiceOutput:
    """One choice's message assembly; `feed` per delta (streaming), then `finish`."""

    def __init__(
        self, mode: str, parser: ToolParser | None = None, named: str | None = None, parallel: bool = True
    ) -> None:
        self.mode = mode
        self.parser = parser
        self.named = named
        self.parallel = parallel  # False: parallel_tool_calls was false, one call at most
        self.text = ""
        self.sent = 0  # chars of `text` already sent as content (auto) or arguments (named)
        self.in_call = False
        self.named_id: str | None = None

    # -- non-streaming -----------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole assistant message and the finish reason to report."""
        content, calls = self._split(text, finish_reason)
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            msg["tool_calls"] = calls
            return msg, "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason

    def _split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]]]:
        if self.mode == "named":
            assert self.named is not None
            call = {"id": self.named_id or new_call_id(), "type": "function"}
            return None, [{**call, "function": {"name": self.named, "arguments": text}}]
        truncated = finish_reason == "length"
        if self.mode == "required":
            calls = _required_calls(text, truncated)
            if calls is None:  # not the constrained shape (cannot happen under the grammar)
                return text, []
            return None, _calls_json(self._allowed(calls))
        if self.mode == "auto" and self.parser is not None:
            content, parsed = self.parser.parse(text, truncated)
            if parsed or content != text:
                return content or None, _calls_json(self._allowed(parsed))
        return text, []

    def _allowed(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.parallel else calls[:1]

    # -- streaming ---------------------------------------------------------------------------
    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas to send for newly generated text."""
        self.text += delta
        if self.mode == "none":
            return [{"content": delta}] if delta else []
        if self.mode == "named":
            return self._named_delta()
        if self.mode == "required" or self.in_call:
            return []
        assert self.parser is not None
        at = self.parser.call_starts(self.text)
        if at >= 0:
            self.in_call = True
            return self._content_upto(at)
        marker = self.parser.start
        hold = _partial_marker(self.text, marker) if marker else 0
        return self._content_upto(len(self.text) - hold)

    def _content_upto(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent:
            return []
        piece, self.sent = self.text[self.sent : end], end
        return [{"content": piece}]

    def _named_delta(self) -> list[dict[str, Any]]:
        piece = self.text[self.sent :]
        first = self.named_id is None
        if not piece and not first:
            return []
        self.sent = len(self.text)
        if first:
            self.named_id = new_call_id()
            call = {"index": 0, "id": self.named_id, "type": "function"}
            return [{"tool_calls": [{**call, "function": {"name": self.named, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}]

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas of the choice and the finish reason to report."""
        if self.mode == "none":
            return [], finish_reason
        if self.mode == "named":
            out = self._named_delta()
            return out, "tool_calls" if finish_reason == "stop" else finish_reason
        content, calls = self._split(self.text, finish_reason)
        if not calls:  # no call: what was held back is content, unless it was a cut call
            return self._content_upto(len(content or "")), finish_reason
        out: list[dict[str, Any]] = []
        if self.mode == "auto" and content and len(content) > self.sent:
            out += self._content_upto(len(content))
        out.append(
            {
                "tool_calls": [
                    {"index": i, "id": c["id"], "type": "function", "function": c["function"]}
                    for i, c in enumerate(calls)
                ]
            }
        )
        return out, "tool_calls" if finish_reason == "stop" else finish_reason
