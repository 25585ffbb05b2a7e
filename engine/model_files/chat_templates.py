"""Chat templates: HF's Jinja sandbox, message normalization, and the template a model ships.

Templates render in `ImmutableSandboxedEnvironment` with HF's `tojson`, `raise_exception`
and `strftime_now`; messages are checked and flattened first so a bad request is a
`ChatTemplateError` (a 400 upstream), never a template crash. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "hf_templates", "read_json", "render_chat"]


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or the template's own `raise_exception`."""


# The template of models that ship none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson` filter: unlike Jinja's built-in it keeps non-ASCII and HTML as is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> Any:
    """The sandbox HF renders chat templates in, plus a pass-through `{% generation %}` tag."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """HF's assistant-mask marker: renders its body unchanged (we need no masks)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile_template(source: str) -> Any:
    import jinja2

    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the model's chat template does not compile: {err}") from err


def _flatten_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}.content[{j}].text must be a string")
                texts.append(text)
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"{where}.content[{j}] of type {kind!r} is not supported: only text parts are"
                )
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string or a list of text parts")


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Copy tool calls, parsing JSON-string arguments into objects as templates expect."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    out = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{where}.tool_calls entries must be objects")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            fn = dict(fn)
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # leave unparsable arguments as the string the client sent
            call["function"] = fn
        out.append(call)
    return out


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role must be a non-empty string")
        msg = dict(message)
        if msg.get("tool_calls") is not None:
            msg["tool_calls"] = _normalize_tool_calls(msg["tool_calls"], where)
        content = msg.get("content")
        if content is None:
            if msg.get("tool_calls") is None:
                raise ChatTemplateError(f"{where}.content is required")
            msg["content"] = ""
        else:
            msg["content"] = _flatten_content(content, where)
        out.append(msg)
    return out


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file of a Hugging Face directory; {} when absent or not an object."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def hf_templates(path: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(default template, named templates) of a Hugging Face directory."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), {}
    value = config.get("chat_template")
    if value is None:
        value = read_json(path / "chat_template.json").get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in value if isinstance(t, Mapping)}
        return named.pop("default", None), named
    return (value if isinstance(value, str) else None), {}


def render_chat(
    source: str | None,
    messages: Any,
    tools: Any,
    context: Mapping[str, Any],
    add_generation_prompt: bool,
) -> str:
    """Render `messages` (and `tools`) with `source`, ChatML when None; `context` holds the
    special tokens and the caller's extra template variables."""
    import jinja2

    msgs = _normalize_messages(messages)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise ChatTemplateError("tools must be a list of objects")
    template = _compile_template(source or CHATML_TEMPLATE)
    values = {**context, "messages": msgs, "tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(**values)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as err:
        raise ChatTemplateError(f"chat template failed on these messages: {err}") from err
