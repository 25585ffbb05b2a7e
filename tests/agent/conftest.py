"""Fixtures for agent tests: a tiny random Llama directory (with its own tiny byte-level
BPE tokenizer) that an engine replica loads in about a second, a real nats-server, and
helpers that run `python -m agent` as a child process and clean up every process it
leaves behind (replicas live in their own sessions)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import uvicorn

from agent.gateway.app import build_app
from agent.gateway.gateway import Gateway
from control_plane.local.nats_server import NatsServer
from fleet_base import protocol
from fleet_base.api_keys import ApiKeyRecord, hash_secret, new_secret
from fleet_base.cluster_config import ClusterConfig
from fleet_base.nats_io import NatsLink, ensure_jetstream
from fleet_base.processes import stop_process
from fleet_base.protocol import ClusterRoute, DesiredState, ReplicaSpec, RoutingTable

ROOT = Path(__file__).resolve().parents[2]
TINY_VOCAB = 320


def make_tiny_model_dir(out: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama in Hugging Face layout (config.json, model.safetensors,
    tokenizer.json). Written with numpy directly: importing transformers costs ~10 s."""
    from safetensors.numpy import save_file
    from tokenizers import ByteLevelBPETokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    corpus = ["hello world, the quick brown fox jumps over the lazy dog"] * 4
    tok.train_from_iterator(corpus, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    hidden, inter, layers, heads, kv_heads = 64, 128, 2, 4, 2
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": TINY_VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(TINY_VOCAB, hidden),
        "lm_head.weight": w(TINY_VOCAB, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("agent-tiny") / "tiny-llama")


def processes_using(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker` (a unique tmp path of ours)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and any(marker in part for part in proc.info["cmdline"] or []):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
    return found


def kill_processes_using(marker: str) -> None:
    for proc in processes_using(marker):
        with contextlib.suppress(psutil.Error):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.kill()


@pytest.fixture
def model_dir(tiny_model: Path, tmp_path: Path) -> Iterator[Path]:
    """The tiny model under a path unique to this test (a symlink), so every replica the
    test starts can be found and killed by it at teardown, even if an agent died."""
    link = tmp_path / "model"
    link.symlink_to(tiny_model, target_is_directory=True)
    yield link
    kill_processes_using(str(link))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


def cluster_config(tmp_path: Path, nats_url: str, **overrides: object) -> ClusterConfig:
    """A CPU cluster config tuned for fast tests (tiny KV cache, one thread, quick backoff)."""
    data: dict = {
        "cluster": "test-east",
        "region": "local-east",
        "coordinates": {"lat": 40.7, "lon": -74.0},
        "nats_url": nats_url,
        "state_dir": str(tmp_path / "state"),
        "heartbeat_interval_s": 0.5,
        "cpu_slots": 2,
        "gateway": {"port": 9999},
        "replica": {
            "extra_args": ["--threads", "1", "--kv-cache-memory", "2MiB", "--log-level", "warning"],
            "startup_timeout_s": 60,
            "drain_timeout_s": 5,
            "restart_backoff_s": 0.2,
            "restart_backoff_max_s": 2,
        },
    }
    data.update(overrides)
    return ClusterConfig.model_validate(data)


class AgentProcess:
    """`python -m agent --config <tmp>/cluster.yaml` as a child; logs to <tmp>/agent-N.log."""

    def __init__(self, config: ClusterConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / "cluster.yaml"
        config.dump(self.config_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"agent-{self.runs}.log"

    def start(self) -> AgentProcess:
        self.runs += 1
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent", "--config", str(self.config_path)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[[ClusterConfig], AgentProcess]]:
    agents: list[AgentProcess] = []

    def make(config: ClusterConfig) -> AgentProcess:
        agent = AgentProcess(config, tmp_path)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        if agent.proc is not None:
            stop_process(agent.proc, 20)


async def publish_cluster_state(
    link: NatsLink, cluster: str, specs: list[ReplicaSpec], key_id: str, key_record: object
) -> None:
    """What the control plane would publish for one cluster: its desired replicas, a route
    per deployment to this cluster alone, and one API key."""
    await link.kv_put(
        protocol.BUCKET_DESIRED, cluster, DesiredState(cluster=cluster, generation=1, replicas=specs)
    )
    for deployment in sorted({s.deployment for s in specs}):
        route = RoutingTable(deployment=deployment, clusters=[ClusterRoute(cluster=cluster)])
        await link.kv_put(protocol.BUCKET_ROUTES, deployment, route)
    await link.kv_put(protocol.BUCKET_KEYS, key_id, key_record)


async def seed_cluster(nats_url: str, cluster: str, specs: list[ReplicaSpec]) -> tuple[str, str]:
    """`publish_cluster_state` with a fresh inference key, through a connection of its own:
    the key's id and secret."""
    key_id, secret = new_secret()
    salt, digest = hash_secret(secret)
    record = ApiKeyRecord(key_id=key_id, name="t", salt=salt, hash=digest, scopes=["inference"])
    link = NatsLink(nats_url, "test-control")
    link.start()
    assert await link.wait_connected(10) and link.nc is not None
    await ensure_jetstream(link.nc.jetstream())
    await publish_cluster_state(link, cluster, specs, key_id, record)
    await link.close()
    return key_id, secret


@contextlib.asynccontextmanager
async def live_gateway(cfg: ClusterConfig) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """The cluster's gateway in this process on a real socket, and a client of it."""
    app = build_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.gateway.port, log_level="warning"))
    serve = asyncio.create_task(server.serve())
    try:
        base_url = f"http://127.0.0.1:{cfg.gateway.port}"
        async with httpx.AsyncClient(base_url=base_url, timeout=60, trust_env=False) as client:
            yield app.state.gateway, client
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve, 10)
