"""Tool calls as clients of vLLM expect them, through the openai SDK against real replicas:
`parallel_tool_calls: false` gives exactly one call, and a forced call array cut by max_tokens
comes back as its complete calls in `tool_calls` with `finish_reason: "length"`, never as JSON
text in `content`. A tiny random-weight model (the grammar forces the shape whatever the
weights), then real SmolLM2, which at temperature 0 repeats `get_weather` until max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from engine.model_files.aliases import resolve_model_path
from engine.server.process import ServerProcess
from engine.tokenizer import Tokenizer
from tests.engine.server.conftest import MODEL
from tests.engine.tiny_checkpoints import make_tiny_hf_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _ask(
    client: openai.OpenAI, model: str, stream: bool, **kw: Any
) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of choice 0, assembled as the SDK does."""
    args = {"model": model, "messages": ASK, "temperature": 0, **kw}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for c in ch.delta.tool_calls or []:
                name, arguments = parts.get(c.index, ("", ""))
                parts[c.index] = (name + (c.function.name or ""), arguments + (c.function.arguments or ""))
            finish = ch.finish_reason or finish
    assert finish is not None
    return content or None, [parts[i] for i in sorted(parts)], finish


def _conform(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template."""
    root = tmp_path_factory.mktemp("tool-parity")
    out = root / "tiny"
    tok = Tokenizer.from_path(resolve_model_path("smollm2-135m"))
    make_tiny_hf_checkpoint(out, vocab_size=tok.vocab_size, seed=7, max_position_embeddings=1024)
    tok.backend.save(str(out / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": tok.chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    with ServerProcess("--max-model-len", "1024", "--served-model-name", "tiny", model=str(out),
                       log_path=root / "server.log") as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="module")
def tiny_client(tiny: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_parallel_false_is_exactly_one_call(tiny_client: openai.OpenAI, stream: bool) -> None:
    for tools in ([WEATHER], [WEATHER, TIME]):
        content, calls, finish = _ask(
            tiny_client, "tiny", stream, tools=tools, tool_choice="required", parallel_tool_calls=False,
            max_tokens=200,
        )  # fmt: skip
        assert content is None and len(calls) == 1 and finish == "tool_calls", (content, calls, finish)
        _conform(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_cut_required_array_is_its_complete_calls(tiny_client: openai.OpenAI, stream: bool) -> None:
    full_content, full, _ = _ask(
        tiny_client, "tiny", stream, tools=[WEATHER, TIME], tool_choice="required", max_tokens=400
    )
    assert full_content is None and full
    _conform(full)
    seen = []
    for max_tokens in (1, 3, 8, 13, 21, 34, 55, 89, 144):
        content, calls, finish = _ask(
            tiny_client, "tiny", stream, tools=[WEATHER, TIME], tool_choice="required", max_tokens=max_tokens
        )
        assert content is None, f"max_tokens={max_tokens}: text in content {content!r}"
        assert finish in ("length", "tool_calls")
        if finish == "tool_calls":
            assert calls == full
        assert calls == full[: len(calls)]  # greedy: the complete calls of the full answer, in order
        _conform(calls)
        seen.append(len(calls))
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] >= 2  # cuts inside a call and after several


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_cut_named_call_is_a_tool_call(tiny_client: openai.OpenAI, stream: bool) -> None:
    content, calls, finish = _ask(
        tiny_client, "tiny", stream, tools=[WEATHER], tool_choice=NAMED, max_tokens=4
    )
    assert content is None and finish == "length"
    assert [name for name, _ in calls] == ["get_weather"]


@pytest.fixture(scope="module")
def smol(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_get_weather_repeated_until_max_tokens(smol: openai.OpenAI, stream: bool) -> None:
    content, calls, finish = _ask(smol, MODEL, stream, tools=[WEATHER], tool_choice="required", max_tokens=64)
    assert finish == "length" and content is None, (content, finish)
    assert len(calls) >= 2 and {name for name, _ in calls} == {"get_weather"}
    _conform(calls)
    assert json.loads(calls[0][1])["city"] == "Paris"
    content, one, finish = _ask(
        smol,
        MODEL,
        stream,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        parallel_tool_calls=False,
    )
    assert content is None and finish == "tool_calls" and one == calls[:1]
