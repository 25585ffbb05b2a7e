"""Every client mistake gets a 4xx in OpenAI's error shape, from the real server process."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine.server.process import ServerProcess
from tests.engine.server.conftest import MODEL

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, says: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param
    assert says.lower() in err["message"].lower(), err["message"]
    return err


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_error(r, 400, says="not valid JSON")
    assert_error(http.post("/v1/completions", content=b"[1, 2]"), 400, says="JSON object")
    assert_error(http.post("/v1/completions", content=b""), 400, says="not valid JSON")


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        # wrong types
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature", "valid number"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": "10"}, "max_tokens", "valid integer"),
        ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream", "valid boolean"),
        ("/v1/chat/completions", {**CHAT, "n": 1.5}, "n", "valid integer"),
        ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop", "string or a list"),
        ("/v1/chat/completions", {**CHAT, "model": 3}, "model", "valid string"),
        ("/v1/completions", {**COMP, "prompt": {"text": "hi"}}, "prompt", "prompt must be"),
        ("/v1/completions", {**COMP, "prompt": [1, "a"]}, "prompt", "prompt must be"),
        # empty or malformed messages, unknown roles
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages", "valid array"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, "messages.0.role", "required"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
            "messages.0.role",
            "'user'",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0", "needs 'content'"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": 7}]},
            "messages.0.content",
            "",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0",
            "only 'text'",
        ),
        ("/v1/chat/completions", {"model": MODEL}, "messages", "required"),
        ("/v1/completions", {"model": MODEL}, "prompt", "required"),
        ("/v1/completions", {**COMP, "prompt": []}, "prompt", "empty"),
        ("/v1/completions", {**COMP, "prompt": [[]]}, "prompt", "non-empty"),
        ("/v1/completions", {**COMP, "prompt": [10**9]}, "prompt", "outside the vocabulary"),
        # out-of-range parameters
        ("/v1/chat/completions", {**CHAT, "temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "less than or equal to 2"),
        ("/v1/completions", {**COMP, "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/completions", {**COMP, "top_p": 1.5}, "top_p", "less than or equal to 1"),
        ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "greater than or equal to 1"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", {**COMP, "max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", ""),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
        ("/v1/completions", {**COMP, "logprobs": 21}, "logprobs", "20"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, "requires logprobs"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": True}},
            None,
            "only allowed when stream",
        ),
        (
            "/v1/completions",
            {**COMP, "stream": False, "stream_options": {"include_usage": True}},
            None,
            "stream",
        ),
        ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop", "empty"),
        (
            "/v1/chat/completions",
            {**CHAT, "presence_penalty": 3},
            "presence_penalty",
            "less than or equal to 2",
        ),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"50": 10}}, None, "logit_bias"),
        ("/tokenize", {"prompt": "a", "messages": MSGS}, None, "exactly one"),
        ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "valid array"),
    ],
)
def test_invalid_request_is_400(
    http: httpx.Client, path: str, body: dict, param: str | None, says: str
) -> None:
    err = assert_error(http.post(path, json=body), 400, param=param, says=says)
    assert err["type"] == "invalid_request_error"


def test_unknown_model_is_404(http: httpx.Client, server: ServerProcess) -> None:
    err = assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, param="model")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_context_overflow_names_limit_and_count(http: httpx.Client, path: str) -> None:
    tokens = http.post("/tokenize", json={"prompt": "hello"}).json()
    limit = tokens["max_model_len"]
    body = {**CHAT, "max_tokens": limit} if "chat" in path else {**COMP, "max_tokens": limit}
    err = assert_error(http.post(path, json=body), 400, says=f"maximum context length is {limit} tokens")
    assert err["code"] == "context_length_exceeded"
    n_prompt = int(err["message"].split("(")[1].split(" in the prompt")[0])
    assert n_prompt >= 1 and f"you requested {n_prompt + limit} tokens" in err["message"]
    # a prompt that alone fills the window, no max_tokens given (chat default: up to the window)
    long = " ".join(["word"] * (limit + 10))
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": long}]}
    if "chat" not in path:
        long_body = {"model": MODEL, "prompt": long}
    err = assert_error(http.post(path, json=long_body), 400, says=f"maximum context length is {limit}")
    assert err["code"] == "context_length_exceeded"


def test_body_too_large_is_413(http: httpx.Client) -> None:
    big = {**COMP, "prompt": "x" * 70_000}  # the shared server runs with --max-request-bytes 65536
    err = assert_error(http.post("/v1/completions", json=big), 413, says="65536 bytes")
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies to the streamed body
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.post("/v1/audio/speech", json={}), 404, says="/v1/audio/speech")
    assert_error(http.get("/v1/chat/completions"), 405, says="GET")


def test_explicit_nulls_mean_defaults(http: httpx.Client) -> None:
    nulls = {
        k: None for k in ("n", "stop", "stream", "stream_options", "logprobs", "temperature", "seed", "user")
    }
    r = http.post("/v1/completions", json={**COMP, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = http.post(
        "/v1/chat/completions", json={**CHAT, **nulls, "top_logprobs": None, "max_completion_tokens": None}
    )
    assert r.status_code == 200, r.text


def test_server_still_healthy_after_bad_input(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={**COMP, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
