"""The simulated replica as a real process, through real clients (httpx, openai SDK), and
runtime `sim` starting, probing and stopping one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from agent.replica_metrics import parse_metrics
from agent.runtime import make_runtime
from agent.sim.server import placeholder, token_ids
from fleet_base.cluster_config import ClusterConfig
from fleet_base.openai_contract.timing import TTFT_HEADER
from fleet_base.ports import free_port
from fleet_base.protocol import ReplicaSpec, ReplicaState
from tests.polling import eventually, wait_for

ROOT = Path(__file__).resolve().parents[3]


def start(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.sim.server",
            "--port",
            str(port),
            "--served-model-name",
            "sim-d",
            "--threads",
            "1",
            *args,
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_status(url: str, code: int, timeout: float = 20.0) -> list[int]:
    """Every status /health answered until it answered `code` (a refused connection is "not yet")."""
    seen: list[int] = []

    def answered() -> list[int] | None:
        seen.append(httpx.get(f"{url}/health", timeout=1).status_code)
        return seen if seen[-1] == code else None

    return wait_for(answered, timeout, f"/health to answer {code}", 0.05, retry_errors=httpx.HTTPError)


@pytest.fixture
def replica() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    proc, url = start("--cold-start", "1.0", "--profile", "llama2-70b-h100-tp4")
    yield proc, url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_cold_start_then_openai_api(replica) -> None:
    _proc, url = replica
    t0 = time.monotonic()
    seen = wait_status(url, 200)
    assert 503 in seen and time.monotonic() - t0 >= 0.8  # loading while cold
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    t = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="sim-d", messages=[{"role": "user", "content": "hi " * 400}], max_tokens=20
    )
    took = time.monotonic() - t
    r = raw.parse()
    # its own time to first token: the prefill, well before the 19 decode steps end
    ttft = float(raw.headers[TTFT_HEADER])
    assert 0 < ttft < took / 2
    assert r.system_fingerprint == "simulated"
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens > 200
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert 0.5 < took < 3  # ~50 ms prefill + 19 steps of ~30 ms: real time from the profile

    streamed = client.completions.with_raw_response.create(
        model="sim-d", prompt="x", max_tokens=30, stream=True, stream_options={"include_usage": True}
    )
    assert TTFT_HEADER not in streamed.headers  # a stream's first token is its reader's to time
    chunks = list(streamed.parse())
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 3 and all(c.system_fingerprint == "simulated" for c in chunks)
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].choices == []
    assert [m.id for m in client.models.list().data] == ["sim-d"]
    raw_resp = client.responses.with_raw_response.create(
        model="sim-d", input="hi " * 40, instructions="be brief", max_output_tokens=5
    )
    assert 0 < float(raw_resp.headers[TTFT_HEADER]) < took
    resp = raw_resp.parse()
    assert resp.output_text and resp.usage.output_tokens == 5 and resp.usage.input_tokens > 20
    bad = httpx.post(
        f"{url}/v1/responses", json={"model": "sim-d", "input": "x", "previous_response_id": "r"}
    )
    assert bad.status_code == 400 and "previous_response_id" in bad.json()["error"]["message"]

    sample = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert sample.generation_tokens == 55 and sample.running == 0
    # The work the autoscaler reads: prompt tokens, and the TTFT of the three requests.
    assert sample.prompt_tokens > 200 and sample.ttft_count == 3 and 0 < sample.ttft_sum < 2
    # And their prompt lengths (the mix): one count per request, the long one's bucket above 32.
    assert sample.prompt_buckets[-1] == (float("inf"), 3.0)
    assert dict(sample.prompt_buckets)[32.0] < 3

    bad = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]}
    )
    assert bad.status_code == 404 and "sim-d" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/completions", json={"model": "sim-d", "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.post(f"{url}/v1/completions", content=b"{nope").status_code == 400


def test_concurrency_shows_in_metrics_and_sigterm_drains(replica) -> None:
    proc, url = replica
    wait_status(url, 200)

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"model": "sim-d", "prompt": "y" * 400, "max_tokens": 40}
            tasks = [asyncio.create_task(c.post(f"{url}/v1/completions", json=body)) for _ in range(8)]

            async def all_running() -> list[float] | None:  # or a request already done: fails below
                running = parse_metrics((await c.get(f"{url}/metrics")).text).running
                return [running] if running == 8 or any(t.done() for t in tasks) else None

            (running,) = await eventually(all_running, 30, "8 requests running at once", 0.02)
            proc.send_signal(signal.SIGTERM)  # drains: in-flight requests still complete
            codes = [r.status_code for r in await asyncio.gather(*tasks)]
            return [int(running), *codes]

    running, *codes = asyncio.run(load())
    assert running == 8 and codes == [200] * 8
    assert proc.wait(timeout=10) == 0


def test_error_rate_fails_requests() -> None:
    proc, url = start("--cold-start", "0", "--error-rate", "1")
    try:
        wait_status(url, 200)
        r = httpx.post(f"{url}/v1/completions", json={"model": "sim-d", "prompt": "x"})
        assert r.status_code == 500 and "simulated" in r.json()["error"]["message"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_diverged_text_differs_from_its_token_on() -> None:
    """A version with --text-diverge-at K answers as one without it up to token K, then
    differently in text (from the token's first character) and in ids."""
    same, other = placeholder(0, 6), placeholder(0, 6, diverge_at=2)
    assert other.startswith(placeholder(0, 2)) and other != same
    assert other[len(placeholder(0, 2))] != same[len(placeholder(0, 2))]
    assert token_ids(0, 6)[:2] == token_ids(0, 6, 2)[:2]
    assert [a == b for a, b in zip(token_ids(0, 6), token_ids(0, 6, 2), strict=True)].index(False) == 2
    assert placeholder(0, 6, diverge_at=10) == same  # past the output: the same text


def stream_chat(url: str, body: dict) -> tuple[str, list[int], dict]:
    """A streamed chat's text, the ids on its chunks (asked with the header) and its usage."""
    from fleet_base.openai_contract.continuation import TOKEN_IDS_FIELD, TOKEN_IDS_HEADER

    text, ids, usage = "", [], {}
    body = {"model": "sim-d", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, **body}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={TOKEN_IDS_HEADER: "1"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                text += choice["delta"].get("content", "")
                ids += choice[TOKEN_IDS_FIELD]
    return text, ids, usage


def test_diverged_replica_streams_its_ids_and_continues_a_stream() -> None:
    proc, url = start("--cold-start", "0", "--text-diverge-at", "2")
    try:
        wait_status(url, 200)
        text, ids, usage = stream_chat(url, {"max_tokens": 6})
        assert (text, ids, usage["completion_tokens"]) == (placeholder(0, 6, 2), token_ids(0, 6, 2), 6)
        # a continuation after 3 tokens streams only the rest, and counts the whole request
        text, ids, usage = stream_chat(url, {"max_tokens": 6, "fleet_resume_token_ids": token_ids(0, 3, 2)})
        assert (text, ids, usage["completion_tokens"]) == (placeholder(3, 6, 2), token_ids(3, 6, 2), 6)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sim_runtime_runs_a_replica(tmp_path: Path) -> None:
    config = ClusterConfig(
        cluster="c1", runtime="sim", state_dir=tmp_path, replica={"extra_args": ["--threads", "1"]}
    )

    async def go() -> None:
        rt = make_runtime(config)
        assert rt.name == "sim"
        spec = ReplicaSpec(
            replica_id="r1",
            deployment="dep",
            version=1,
            model="llama",
            engine_args={"cold_start": 0.5, "error_rate": 0.0},
        )
        h = await rt.start(spec)
        try:
            assert "agent.sim.server" in h.argv and "--cold-start" in h.argv
            states: list[ReplicaState] = []

            async def ready() -> bool:
                states.append((await rt.poll(h)).state)
                return states[-1] == ReplicaState.ready

            # a Python child's start-up on a loaded box, then 0.5 s
            await eventually(ready, 60, "the simulated replica ready")
            assert states[0] == ReplicaState.starting and states[-1] == ReplicaState.ready
            assert await rt.adopt(h)  # the same live simulated replica
            assert await rt.stop(h, drain_timeout_s=5) == 0
        finally:
            await rt.kill(h)
            await rt.close()

    asyncio.run(go())


def test_the_agents_scraper_reads_the_prompt_mix_of_the_requests_since_its_last_scrape(replica) -> None:
    """What a heartbeat carries for the SLO autoscaler: the scraper, between two scrapes of a
    replica, sees only the requests that started in between, spread by their prompt lengths."""
    from agent.replica_metrics import MetricsScraper

    _, url = replica
    wait_status(url, 200)

    def send(words: int) -> int:
        r = httpx.post(
            f"{url}/v1/completions", json={"model": "sim-d", "prompt": "w " * words, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    async def scrape_around(before: list[int], between: list[int]) -> tuple[tuple[int, ...], list[int]]:
        scraper = MetricsScraper()
        try:
            for w in before:
                send(w)
            assert await scraper.scrape("r", url, now=0.0) is not None
            lengths = sorted(send(w) for w in between)
            load = await scraper.scrape("r", url, now=1.0)
        finally:
            await scraper.close()
        assert load is not None
        return load.prompt_sample, lengths

    sample, lengths = asyncio.run(scrape_around([3000] * 4, [20, 20, 20, 900, 900]))
    assert len(sample) == len(lengths)
    for got, sent in zip(sorted(sample), lengths, strict=True):  # each within its doubling bucket
        assert sent / 2 < got < sent * 2, (sample, lengths)
