"""Real parts for gateway tests: two engine replicas of a tiny random Llama (started once
per session), a real nats-server, and a gateway subprocess whose state files the tests
write themselves, playing the agent."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.local.nats_server import NatsServer
from engine.server.launcher import TEST_HOOKS_ENV
from engine.server.process import ServerProcess
from fleet_base.api_keys import ApiKeyRecord
from tests.agent.conftest import make_tiny_model_dir
from tests.agent.gateway.harness import DEPLOYMENT, GatewayProcess, make_key, peer, replica, route

# ChatML spelled out: the tiny tokenizer has no chat template of its own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EAST = (40.7, -74.0)  # New York


@pytest.fixture(scope="session")
def gw_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = make_tiny_model_dir(tmp_path_factory.mktemp("gw-model") / "tiny")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="session")
def replicas(gw_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Two real replicas serving the deployment, started in parallel. A small unread-output
    bound (test_slow_reader) costs the other tests nothing: their whole answers fit the
    socket buffers, so a replica's queue never holds more than a step or two. The test hooks
    are on (a test freezes the engines so an attempt outlasts a deadline on any machine)."""
    logs = tmp_path_factory.mktemp("gw-replicas")
    args = ["--served-model-name", DEPLOYMENT, "--threads", "1", "--kv-cache-memory", "2MiB"]
    args += ["--max-model-len", "256", "--access-log", "--max-unread-bytes", "64KiB"]
    procs = [ServerProcess(*args, model=str(gw_model), log_path=logs / f"r{i}.log") for i in (1, 2)]
    errors: list[BaseException] = []

    def start(p: ServerProcess) -> None:
        try:
            p.start(timeout=120)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TEST_HOOKS_ENV, "1")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    try:
        if errors:
            raise errors[0]
        yield procs
    finally:
        for p in procs:
            p.terminate()  # both drain at once
        for p in procs:
            p.stop(timeout=10)


@pytest.fixture(scope="session")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("gw-nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def keys() -> dict[str, tuple[str, ApiKeyRecord]]:
    """name -> (secret, record)."""
    return {
        "main": make_key("main"),
        "other": make_key("other", deployments=["other"]),
        "revoked": make_key("revoked", revoked=True),
        "admin": make_key("admin", scopes=["admin"]),
        "readonly": make_key("readonly", scopes=["read"]),
        "usage": make_key("usage"),
    }


@pytest.fixture(scope="session")
def east_process(tmp_path_factory: pytest.TempPathFactory, nats: NatsServer) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(
        tmp_path_factory.mktemp("gw-east"), "east", nats_url=nats.url, lat=EAST[0], lon=EAST[1], queue_size=2
    )
    gw.start()
    yield gw
    gw.stop()


@pytest.fixture
def east(
    east_process: GatewayProcess, replicas: list[ServerProcess], keys: dict[str, tuple[str, ApiKeyRecord]]
) -> GatewayProcess:
    """The east gateway with both replicas ready, every test key, and a route of its own."""
    east_process.write(
        replicas=[replica("r1", replicas[0].url), replica("r2", replicas[1].url)],
        keys=[record for _, record in keys.values()],
        routes=[route(DEPLOYMENT, [peer("east", east_process.url, *EAST)])],
    )
    return east_process


@pytest.fixture
def secret(keys: dict[str, tuple[str, ApiKeyRecord]]) -> str:
    return keys["main"][0]
