"""llama.cpp under Fleet for real: a local fleet (`fleetctl up`) deploys SmolLM2's GGUF with
`--engine llama.cpp`; the agent runs llama.cpp's own `llama-server` (bench/llama_cpp_build.py
builds it; the test skips without one). Through the gateway with API keys: chat, streaming
and usage, a request quota's 429; the agent reads the replicas' load from their `llamacpp:*`
series and the autoscaler adds a replica on it; a replica killed under load costs no request
(retried on the other one)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from control_plane.local.fleet import LocalFleet
from fleet_base.engine_binaries import EngineNotFound, find_executable, serves_tls
from fleet_base.local_state import LocalState
from tests.e2e.sim_fleet import wait_for
from tests.fleetctl import fleetctl, fleetctl_json

pytestmark = pytest.mark.slow

REGION = "local-east"
DEPLOYMENT = "smollm2-cpp"
MESSAGES = [{"role": "user", "content": "Name one colour."}]
# Load that keeps a slot busy for its whole max_tokens (a short answer would end at once).
LONG = [{"role": "user", "content": "Write a long story about a river, in many paragraphs."}]


@pytest.fixture(scope="module")
def llama_server() -> str:
    try:
        return find_executable("llama.cpp")
    except EngineNotFound as err:
        pytest.skip(f"no llama-server binary on this machine: {err}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, llama_server: str, smollm2_gguf: Path):
    home = tmp_path_factory.mktemp("fleet-home")
    local = LocalFleet(home)
    env = {"FLEET_LLAMA_SERVER": llama_server}
    try:
        up = fleetctl_json(home, "up", "--detach", "--regions", REGION, env=env, timeout=300)
        yield home, up["clusters"][0]["gateway"]
    finally:
        state = local.load()
        fleetctl(home, "down", check=False, timeout=120)
        if state is not None:  # never leave processes behind
            for proc in local.marked_processes(state.fleet_id):
                proc.kill()


def _state_dir(home: Path) -> Path:
    return LocalFleet(home).dir / "clusters" / REGION / "state"


def _replicas(home: Path) -> list:
    snapshot = LocalState(_state_dir(home)).load_replicas()
    return [r for r in (snapshot.replicas if snapshot else []) if r.deployment == DEPLOYMENT]


def _ready(home: Path, n: int) -> dict:
    status = fleetctl_json(home, "status", DEPLOYMENT)
    return status if status["ready_replicas"] >= n else {}


def _client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, max_tokens: int = 8, messages: list[dict] = MESSAGES):
    return client.chat.completions.create(
        model=DEPLOYMENT, messages=messages, max_tokens=max_tokens, temperature=0
    )


def _load(gateway: str, key: str, n: int, max_tokens: int) -> list[str]:
    """n non-streamed requests at once; the errors."""

    def one(i: int) -> str | None:
        try:
            reply = _chat(_client(gateway, key), max_tokens, LONG)
            assert reply.usage is not None and reply.usage.completion_tokens > 0
            return None
        except Exception as err:
            return f"request {i}: {type(err).__name__}: {err}"

    with cf.ThreadPoolExecutor(n) as pool:
        return [e for e in pool.map(one, range(n)) if e]


def _load_until(gateway: str, key: str, n: int, done, timeout: float) -> list[str]:
    """n requests at a time, again and again, until `done()` (checked between rounds) or
    `timeout`; the errors (one that was not done in time included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        errors = _load(gateway, key, n, 32)
        if errors or done():
            return errors
    return [f"not done after {timeout:.0f} s of load"]


def _desired(home: Path) -> int:
    return fleetctl_json(home, "status", DEPLOYMENT)["desired_replicas"]


def test_llama_cpp_deployment_serves_meters_scales_and_survives_a_kill(
    fleet, llama_server: str, smollm2_gguf: Path
):
    home, gateway = fleet
    deployed = fleetctl_json(
        home,
        "deploy", DEPLOYMENT,
        "--engine", "llama.cpp",
        "--model", str(smollm2_gguf),
        "--min-replicas", "1", "--max-replicas", "2", "--target-concurrency", "1",
        "-e", "threads=1", "-e", "parallel=4", "-e", "ctx_size=4096",
    )  # fmt: skip
    assert deployed["engine"] == "llama.cpp"
    status = wait_for(lambda: _ready(home, 1), 60, 0.5, "a ready llama.cpp replica")
    ready = [p for p in status["placements"] if p["state"] == "ready"]
    assert ready and ready[0]["startup"].get("cold_start") is not None  # cold start measured
    replica = next(r for r in _replicas(home) if r.state == "ready")
    assert replica.engine == "llama.cpp" and replica.max_adapters == 0
    if serves_tls("llama.cpp", llama_server):  # the replica certificate, as our engine's replicas
        assert replica.url.startswith("https://127.0.0.1:") and not replica.note
    else:  # a build without OpenSSL: loopback HTTP, and the replica says so
        assert replica.url.startswith("http://127.0.0.1:") and "no TLS support" in replica.note
    log = (_state_dir(home) / "logs" / f"{replica.replica_id}.log").read_text()
    assert "llama-server" in log and "--alias smollm2-cpp" in log

    key = fleetctl_json(home, "keys", "create", "cpp-e2e")["key"]
    client = _client(gateway, key)
    reply = wait_for(lambda: _chat(client), 30, 0.3, "the key at the gateway")
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=DEPLOYMENT,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        _chat(_client(gateway, "fleet-nope-nope"))

    limited = fleetctl_json(home, "keys", "create", "cpp-quota", "--requests-per-minute", "2")["key"]
    capped = _client(gateway, limited)
    wait_for(lambda: _chat(capped, 2), 30, 0.3, "the limited key at the gateway")
    _chat(capped, 2)
    with pytest.raises(openai.RateLimitError):
        _chat(capped, 2)

    # Under load the agent reads running/queued requests from llamacpp:* and the autoscaler
    # (target 1 request per replica) asks for the second replica; the load lasts until it does.
    seen: list[tuple[int, int]] = []
    with cf.ThreadPoolExecutor(1) as bg:
        loading = bg.submit(_load_until, gateway, key, 8, lambda: _desired(home) >= 2, 45)
        while not loading.done():
            seen += [(r.load.running, r.load.waiting) for r in _replicas(home) if r.state == "ready"]
            time.sleep(0.2)
        assert loading.result() == []
    assert any(running + waiting > 0 for running, waiting in seen), seen
    status = wait_for(lambda: _ready(home, 2), 60, 0.5, "the autoscaler's second replica")
    assert status["desired_replicas"] == 2

    # One replica dies with requests in flight: they are retried on the other one.
    retries = _retries(gateway)
    with cf.ThreadPoolExecutor(1) as bg:
        loading = bg.submit(_load, gateway, key, 8, 64)
        victim = wait_for(lambda: _busy_replica(home), 20, 0.1, "a replica with requests running")
        os.kill(victim.pid, signal.SIGKILL)
        assert loading.result() == []
    assert _retries(gateway) > retries


def _busy_replica(home: Path):
    return next((r for r in _replicas(home) if r.state == "ready" and r.pid and r.load.running > 0), None)


def _retries(gateway: str) -> float:
    """The gateway's fleet_gateway_retries_total for the deployment."""
    text = httpx.get(f"{gateway}/metrics", timeout=5).text
    prefix = f'fleet_gateway_retries_total{{deployment="{DEPLOYMENT}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))
