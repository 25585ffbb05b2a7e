"""Tool-call parsing, rendering and assembly (pure, no model)."""

from __future__ import annotations

import json

import pytest

from engine.tool_calls.output import ChoiceOutput
from engine.tool_calls.parsers import HermesParser, Llama3JsonParser, MistralParser, parser_for_template
from engine.tool_calls.render import prepare


def test_registry_follows_the_template() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("<|python_tag|>{{ tools }}").name == "llama3_json"
    assert parser_for_template("{% for t in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert parser_for_template(None).name == "hermes"


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            HermesParser(),
            'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "ok",
            [("f", {"a": 1})],
        ),
        (
            HermesParser(),
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>',
            "",
            [("f", {}), ("g", {"b": "x"})],
        ),
        (HermesParser(), "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
        (
            Llama3JsonParser(),
            '{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}',
            "",
            [("f", {"a": 2}), ("g", {})],
        ),
        (Llama3JsonParser(), '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),
        (Llama3JsonParser(), "just words", "just words", []),
        (MistralParser(), 'hm [TOOL_CALLS][{"name": "f", "arguments": {"q": 1}}]', "hm", [("f", {"q": 1})]),
    ],
)
def test_parsers(parser, text: str, content: str, calls: list) -> None:
    got_content, got = parser.parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def _stream(out: ChoiceOutput, pieces: list[str], finish: str = "stop") -> tuple[list[dict], str | None]:
    deltas = [d for p in pieces for d in out.feed(p)]
    last, reason = out.finish(finish)
    return deltas + last, reason


def test_auto_streams_content_then_holds_the_call() -> None:
    deltas, reason = _stream(
        ChoiceOutput("auto", HermesParser()),
        ["Let me ", "check <tool", '_call>{"name": "f", "arguments": {"a": 1}}', "</tool_call>"],
    )
    assert "".join(d.get("content", "") for d in deltas) == "Let me check "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "f", {"a": 1})
    ]
    assert calls[0]["id"].startswith("call_") and reason == "tool_calls"


def test_auto_without_a_call_is_all_content_even_a_partial_marker() -> None:
    deltas, reason = _stream(ChoiceOutput("auto", HermesParser()), ["a <tool", "box"])
    assert "".join(d["content"] for d in deltas) == "a <toolbox" and reason == "stop"


def test_named_streams_argument_deltas_the_sdk_assembles() -> None:
    deltas, reason = _stream(ChoiceOutput("named", named="f"), ['{"a"', ": 1}"])
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "f"
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert json.loads(args) == {"a": 1} and reason == "tool_calls"


def test_required_message() -> None:
    msg, reason = ChoiceOutput("required").message('[{"name": "f", "arguments": {"x": 1}}]', "stop")
    assert (
        msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "f" and reason == "tool_calls"
    )


REPEATED = (
    "[" + ", ".join(f'{{"name": "get_weather", "arguments": {{"city": "c{i}"}}}}' for i in range(4)) + "]"
)


@pytest.mark.parametrize("cut", range(1, len(REPEATED)))
@pytest.mark.parametrize("stream", [False, True])
def test_required_cut_by_max_tokens_returns_the_complete_calls_never_text(cut: int, stream: bool) -> None:
    text = REPEATED[:cut]
    complete = [i for i in range(4) if f'"c{i}"}}}}' in text]  # items whose closing brace is in
    if stream:
        deltas, reason = _stream(
            ChoiceOutput("required"), [text[i : i + 7] for i in range(0, len(text), 7)], "length"
        )
        assert not any("content" in d and d["content"] for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
    else:
        msg, reason = ChoiceOutput("required").message(text, "length")
        assert msg["content"] is None
        calls = msg.get("tool_calls", [])
    assert reason == "length"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": f"c{i}"} for i in complete]
    assert all(c["function"]["name"] == "get_weather" for c in calls)


@pytest.mark.parametrize("mode", ["required", "auto"])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(mode: str, stream: bool) -> None:
    text = (
        REPEATED
        if mode == "required"
        else "".join(
            f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "c{i}"}}}}</tool_call>'
            for i in range(3)
        )
    )
    out = ChoiceOutput(mode, HermesParser() if mode == "auto" else None, parallel=False)
    if stream:
        deltas, reason = _stream(out, [text])
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
    else:
        msg, reason = out.message(text, "stop")
        calls = msg["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "c0"})
    ]
    assert reason == "tool_calls"


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            HermesParser(),
            'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "f", "argu',
            "ok",
            [("f", {})],
        ),
        (HermesParser(), 'ok <tool_call>{"name": "f", "argu', "ok", []),
        (HermesParser(), "just words, cut", "just words, cut", []),
        (
            MistralParser(),
            '[TOOL_CALLS][{"name": "f", "arguments": {"q": 1}}, {"name": "g", "arg',
            "",
            [("f", {"q": 1})],
        ),
        (
            Llama3JsonParser(),
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "param',
            "",
            [("f", {})],
        ),
        (Llama3JsonParser(), '{"not": "a call", "cut', '{"not": "a call", "cut', []),
    ],
)
def test_auto_cut_by_max_tokens_drops_only_the_cut_call(parser, text: str, content: str, calls: list) -> None:
    msg, reason = ChoiceOutput("auto", parser).message(text, "length")
    assert reason == "length" and (msg["content"] or "") == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])
    ] == calls


def test_tool_turns_become_text_for_templates_without_tools() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "w"}}]
    out, template_tools = prepare(messages, tools, "{{ messages }}")
    assert template_tools is None and out[0]["role"] == "system" and '"name": "w"' in out[0]["content"]
    assert '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>' == out[2]["content"]
    assert out[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    native = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
    assert prepare(messages, tools, native) == (messages, tools)
