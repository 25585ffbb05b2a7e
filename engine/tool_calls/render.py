"""Tools and tool turns for chat templates that do not render them.

A template that mentions `tools` renders tool definitions, assistant `tool_calls` and `tool`
messages itself. For one that does not (SmolLM2's, plain ChatML), the same information is
written as text in the Hermes format its parser reads back: the tool list in the system
message, earlier calls as `<tool_call>` blocks, results as `<tool_response>` blocks.
"""

from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON Schema within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template and "tool_calls" in template


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def prepare(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template: unchanged when it renders tools, else as text."""
    if template_renders_tools(template):
        return messages, tools
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            m["content"] = "\n".join([t for t in [text] if t] + [_call_text(c) for c in m.pop("tool_calls")])
        elif m.get("role") == "tool":
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
            m = {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = _INSTRUCTIONS.format(tools=listing)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
