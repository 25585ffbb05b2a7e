"""Parsers of the tool-call formats models are trained on, and the registry that picks one
from the model's chat template.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2/2.5, and
  the format Fleet writes into templates without tool support)
- `llama3_json`: a bare JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` (Llama 3.1/3.2)
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, truncated: bool = False) -> list[Any] | None:
    """Every JSON value in `text` one after another (separated by whitespace or `;`). None if
    one does not parse, unless the text was `truncated` (cut by max_tokens): then the values
    before the cut one."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return values if truncated else None
        values.append(value)


def json_array_items(text: str, truncated: bool = False) -> list[Any] | None:
    """The items of the JSON array `text`; None if it is not one. When `truncated` (cut by
    max_tokens) the array may end early, inside an item: the items complete before the cut."""
    if not truncated:
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        return items if isinstance(items, list) else None
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return None
    items, i = [], i + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items
        items.append(item)


class ToolParser:
    """Splits a model's text into (content, tool calls); calls that do not parse stay content.

    `truncated`: the text was cut by max_tokens, so its last call may be incomplete; the calls
    complete before the cut are returned and the cut one is dropped (never left as content)."""

    name = ""
    start = ""  # the marker that opens a call; streaming holds text back once it appears

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def call_starts(self, text: str) -> int:
        """Where a tool call begins in `text`, or -1."""
        return text.find(self.start) if self.start else -1


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        rest = text[at:]
        if truncated:  # only the blocks closed before the cut
            end = rest.rfind("</tool_call>")
            rest = rest[: end + len("</tool_call>")] if end >= 0 else ""
        calls = []
        for body in self._block.findall(rest):
            values = _json_values(body)
            parsed = [_call(v) for v in values or []]
            if not values or any(c is None for c in parsed):
                return text, []
            calls.extend(c for c in parsed if c is not None)
        return text[:at].rstrip(), calls


class MistralParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        body = text[at + len(self.start) :]
        values = _json_values(body)
        if values is None and truncated:  # cut inside the array of calls
            values = [json_array_items(body, truncated=True) or []]
        items = [x for v in values or [] for x in (v if isinstance(v, list) else [v])]
        calls = [_call(x) for x in items]
        if truncated and not any(c is None for c in calls):
            return text[:at].rstrip(), [c for c in calls if c is not None]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].rstrip(), [c for c in calls if c is not None]


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"

    def call_starts(self, text: str) -> int:
        at = text.find(self.start)
        if at >= 0:
            return at
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else -1

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[ParsedCall]]:
        at = self.call_starts(text)
        if at < 0:
            return text, []
        body = text[at:].removeprefix(self.start)
        values = _json_values(body, truncated)
        calls = [_call(v, ("parameters", "arguments")) for v in values or []]
        marked = text.startswith(self.start, at)  # a bare `{` may be content, the tag is not
        if truncated and (calls or marked) and not any(c is None for c in calls):
            return text[:at].rstrip(), [c for c in calls if c is not None]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:at].rstrip(), [c for c in calls if c is not None]


PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parser_for_template(template: str | None) -> ToolParser:
    """The parser of the format the template teaches; Hermes for templates without tools
    (Fleet then describes the tools in that format itself, see `render`)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3JsonParser()
    return HermesParser()
