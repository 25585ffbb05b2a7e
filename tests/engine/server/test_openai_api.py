"""The real server process driven by the `openai` SDK (sync and async)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.server.process import ServerProcess
from tests.engine.server.conftest import MODEL, metric, scrape
from tests.polling import eventually, wait_for

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]
UNICODE = [{"role": "user", "content": "Write the word 'hello' in Japanese, Chinese and Greek, with emoji."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_completion_shape_and_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    u = r.usage
    assert (
        u is not None and u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    )
    if choice.finish_reason == "length":
        assert u.completion_tokens == 4
    # the prompt went through the chat template: more tokens than the bare question
    assert u.prompt_tokens > len(QUESTION[0]["content"].split())
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens >= 0


def test_prefix_cache_shows_in_cached_tokens(client: openai.OpenAI) -> None:
    long_system = {"role": "system", "content": "You are a careful assistant. " * 12}
    msgs = [long_system, {"role": "user", "content": "Say yes."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64


def _stream_chat(client: openai.OpenAI, **kw: object) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


@pytest.mark.parametrize("messages", [QUESTION, UNICODE], ids=["ascii", "unicode"])
def test_chat_stream_equals_non_stream_at_temperature_0(client: openai.OpenAI, messages: list) -> None:
    kw = {"messages": messages, "max_tokens": 10, "temperature": 0}
    full = client.chat.completions.create(model=MODEL, **kw)
    text, chunks = _stream_chat(client, **kw)
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    finals = [c for c in chunks if c.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    if messages is UNICODE:
        assert any(ord(ch) > 0x7F for ch in text), f"expected non-ASCII output, got {text!r}"


def test_completions_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Emoji of animals: 🐶 🐱 🐭", "max_tokens": 8, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1


def test_include_usage_adds_a_final_usage_chunk(client: openai.OpenAI) -> None:
    text, chunks = _stream_chat(
        client, messages=QUESTION, max_tokens=6, temperature=0, stream_options={"include_usage": True}
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and c.choices for c in body)
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert text == full.choices[0].message.content


def test_include_usage_raw_sse_has_usage_null_and_done(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "stream": True}
    with_usage = http.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}})
    without = http.post("/v1/completions", json=body)
    assert with_usage.headers["content-type"].startswith("text/event-stream")
    lines = [ln for ln in with_usage.text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]" and without.text.rstrip().endswith("data: [DONE]")
    assert all('"usage":null' in ln for ln in lines[:-2])
    assert '"choices":[]' in lines[-2] and '"prompt_tokens"' in lines[-2]
    assert '"usage"' not in without.text


def test_n2_gives_two_choices(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7}
    with ThreadPoolExecutor(2) as pool:  # concurrently: seeded sampling must not depend on the batch
        r, again = pool.map(lambda _: client.chat.completions.create(**kw), range(2))
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 10
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_n2_streaming_each_choice_finishes_once(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, n=2, temperature=1.0, seed=3, stream=True
        )
    )
    for j in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert sum(ch.finish_reason is not None for ch in mine) == 1 and mine[-1].finish_reason is not None


def test_completions_batch_prompts_times_n(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0) for p in prompts]
    assert [by_index[0], by_index[2]] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_completions_accept_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    text = "The capital of France is"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_lists = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in by_lists.choices] == [by_text.choices[0].text] * 2


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = client.chat.completions.create(stop=[stop, "NEVER-APPEARS"], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index(stop)]
    streamed, chunks = _stream_chat(client, stop=stop, **{k: v for k, v in kw.items() if k != "model"})
    assert streamed == cut.message.content and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0}
    with ThreadPoolExecutor(4) as pool:  # in one batch: a seed's samples must not depend on neighbours
        a, b, *others = pool.map(
            lambda seed: client.completions.create(seed=seed, **kw).choices[0].text, [1234, 1234, 1, 2]
        )
    assert a == b
    assert len({a, *others}) > 1  # sampling really samples
    assert client.completions.create(seed=1234, **kw).choices[0].text == a  # and alone, later


def test_chat_logprobs_concatenate_to_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=UNICODE, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    # a character cut by max_tokens ends the text as U+FFFD, as in the streamed text
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == choice.message.content
    if all(not t.token.startswith("bytes:") for t in content):
        assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
    if choice.finish_reason == "length":
        assert len(content) == r.usage.completion_tokens


def test_chat_logprobs_streamed_match(client: openai.OpenAI) -> None:
    kw = {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    full = client.chat.completions.create(model=MODEL, **kw).choices[0]
    text, chunks = _stream_chat(client, **kw)
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in full.logprobs.content]
    assert "".join(t.token for t in streamed) == text == full.message.content


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=2
    )
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert len(top) == 2 and tok in top


def test_max_tokens_1(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    c = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=1, temperature=0)
    assert c.usage.completion_tokens == 1 and c.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, stream=True))
    assert sum(ch.choices[0].finish_reason is not None for ch in chunks) == 1


def test_sampling_extras_are_accepted(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=5,
        user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


async def test_24_concurrent_requests_all_succeed(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[str, int]:
        if i % 2:
            r = await aclient.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=6,
                temperature=0,
            )
            return r.choices[0].message.content or "", r.usage.completion_tokens
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=f"Number {i} is",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return text, usage

    async with aclient:
        results = await asyncio.gather(*(one(i) for i in range(24)))
    assert len(results) == 24
    assert all(1 <= n <= 6 for _, n in results)


ABORT_WAIT_S = 30.0  # the abort is prompt; the margin is for a loaded box


def _engine_idle(http: httpx.Client) -> dict | None:
    """The engine's metrics once nothing runs, else None (for the polling helpers)."""
    samples = scrape(http)
    return samples if metric(samples, "fleet_engine_requests_running") == 0 else None


def test_dropped_non_streaming_request_is_aborted(server: ServerProcess, http: httpx.Client) -> None:
    before = metric(scrape(http), "fleet_engine_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60.0, read=1.5)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/v1/completions", json=body)
    samples = wait_for(lambda: _engine_idle(http), ABORT_WAIT_S, "the dropped request aborted", 0.05)
    assert metric(samples, "fleet_engine_requests_running") == 0
    assert metric(samples, "fleet_engine_requests_total", finish_reason="abort") == before + 1


def test_tokenize_detokenize_round_trip(http: httpx.Client, client: openai.OpenAI) -> None:
    text = "Grüße, 世界! 🐍"
    tok = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 3
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": QUESTION}).json()
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert chat["count"] == full.usage.prompt_tokens


def test_metrics_expose_every_series(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    s = scrape(http)
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
    ):
        assert metric(s, f"fleet_engine_{name}_count") >= 1
        assert metric(s, f"fleet_engine_{name}_bucket", le="+Inf") == metric(s, f"fleet_engine_{name}_count")
    for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "preemptions_total"):
        assert metric(s, f"fleet_engine_{name}") >= 0
    assert metric(s, "fleet_engine_prompt_tokens_total") >= 3
    # Each request's prompt length, as many as there are first tokens (the autoscaler's mix).
    assert metric(s, "fleet_engine_request_prompt_tokens_count") == metric(
        s, "fleet_engine_time_to_first_token_seconds_count"
    )
    assert metric(s, "fleet_engine_request_prompt_tokens_sum") >= 2  # "Hello there", at least
    assert metric(s, "fleet_engine_generation_tokens_total") >= 3
    assert (
        metric(s, "fleet_engine_prefix_cache_queries_total")
        >= metric(s, "fleet_engine_prefix_cache_hits_total")
        > 0
    )
    assert metric(s, "fleet_engine_requests_total", finish_reason="length") >= 1
    assert 0.0 <= metric(s, "fleet_engine_kv_cache_usage_ratio") <= 1.0


async def test_dropped_stream_frees_the_engine(aclient: openai.AsyncOpenAI, http: httpx.Client) -> None:
    before = metric(scrape(http), "fleet_engine_requests_total", finish_reason="abort")
    async with aclient:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=1500,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        got = 0
        async for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got >= 3:
                break
        assert metric(scrape(http), "fleet_engine_requests_running") == 1
        await stream.close()
    samples = await eventually(lambda: _engine_idle(http), ABORT_WAIT_S, "the dropped stream aborted", 0.05)
    assert metric(samples, "fleet_engine_requests_running") == 0
    assert metric(samples, "fleet_engine_kv_cache_usage_ratio") == 0.0
    assert metric(samples, "fleet_engine_requests_total", finish_reason="abort") == before + 1
