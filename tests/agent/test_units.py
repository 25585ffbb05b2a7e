"""Small pure parts of the agent: engine_args -> argv, /metrics parsing and rates,
nvidia-smi parsing, pool inventory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from agent.inventory import cpu_pool, gpu_pools, inventory, parse_nvidia_smi
from agent.replica_metrics import EngineSample, LoadTracker, parse_metrics
from agent.runtime.base import InvalidSpec
from agent.runtime.command import engine_flags, replica_argv
from engine.outputs import EngineStats
from engine.server.metrics import ServerMetrics
from fleet_base.cluster_config import ClusterConfig, ReplicaConfig
from fleet_base.domain import Tier
from fleet_base.metric_buckets import PROMPT_TOKEN_BUCKETS
from fleet_base.protocol import PoolInventory, ReplicaSpec


def config(tmp_path: Path, **replica: object) -> ClusterConfig:
    return ClusterConfig(cluster="c1", state_dir=tmp_path, replica=ReplicaConfig(**replica))  # type: ignore[arg-type]


# ----------------------------------------------------------------- engine_args -> argv


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        ({}, []),
        ({"max_num_seqs": 8, "threads": 1}, ["--max-num-seqs", "8", "--threads", "1"]),
        ({"enable_x": True, "disable_y": False, "seed": None}, ["--enable-x"]),
        (
            {"kv_cache_memory": "4MiB", "dtype": "float32"},
            ["--kv-cache-memory", "4MiB", "--dtype", "float32"],
        ),
        ({"temperature": 0.5, "offset": -3}, ["--temperature", "0.5", "--offset", "-3"]),
        ({"x": "-1.5e3"}, ["--x", "-1.5e3"]),
        ({"kv_offloading_size": 4}, ["--kv-offloading-size", "4"]),  # the engine's host KV tier
    ],
)
def test_engine_flags(args: dict, flags: list[str]) -> None:
    assert engine_flags(args) == flags


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ({"Max": 1}, "must match"),
        ({"a-b": 1}, "must match"),
        ({"x; rm -rf /": 1}, "must match"),
        ({"--api-key": "k"}, "must match"),
        ({"port": 1}, "set by the agent"),
        ({"model": "other"}, "set by the agent"),
        ({"served_model_name": "x"}, "set by the agent"),
        ({"device": "--api-key"}, "would read as a flag"),
        ({"device": "cuda\n--port 1"}, "control characters"),
        ({"device": ""}, "1..4096"),
        ({"stop": ["a", "b"]}, "string, number or boolean"),
        ({"x": float("nan")}, "finite"),
    ],
)
def test_engine_flags_refuses_unsafe_input(args: dict, reason: str) -> None:
    with pytest.raises(InvalidSpec, match=reason):
        engine_flags(args)


def test_replica_argv(tmp_path: Path) -> None:
    spec = ReplicaSpec(
        replica_id="r1", deployment="chat", version=2, model="smollm2-135m", engine_args={"max_num_seqs": 4}
    )
    cfg = config(tmp_path, extra_args=["--threads", "1"], drain_timeout_s=7)
    argv = replica_argv(spec, cfg, port=8123, python="py")
    assert argv == [
        "py", "-m", "engine.server", "--model", "smollm2-135m", "--served-model-name", "chat",
        "--host", "127.0.0.1", "--port", "8123", "--max-num-seqs", "4", "--threads", "1",
        "--drain-timeout", "7.0",
    ]  # fmt: skip
    cfg = config(tmp_path, extra_args=["--drain-timeout", "3"])
    assert replica_argv(spec, cfg, port=1, python="py")[-2:] == ["--drain-timeout", "3"]
    with pytest.raises(InvalidSpec, match="model"):
        replica_argv(spec.model_copy(update={"model": "-x"}), cfg, port=1)


def test_planner_keys_reach_the_simulated_replica_but_no_real_engine(tmp_path: Path) -> None:
    """`profile`, `profile_<GPU>` and `cold_start` describe the deployment to the planner: our
    engine's argparse (and vLLM's) would stop on them as unknown flags."""
    from agent.runtime.command import foreign_argv
    from agent.runtime.sim import SIM_MODULE
    from engine.server.launcher import build_parser

    args = {"profile": "A100", "profile_h100": "h100", "cold_start": 30, "max_num_seqs": 4}
    spec = ReplicaSpec(replica_id="r1", deployment="chat", version=1, model="m", engine_args=args)
    cfg = config(tmp_path)
    real = replica_argv(spec, cfg, port=8123, python="py")
    assert not {"--profile", "--profile-h100", "--cold-start"} & set(real)
    assert "--max-num-seqs" in real
    build_parser().parse_args(real[3:])  # the engine accepts every flag it is given
    sim = replica_argv(spec, cfg, port=8123, python="py", module=SIM_MODULE)
    assert {"--profile", "--profile-h100", "--cold-start"} <= set(sim)
    vllm = spec.model_copy(update={"engine": "vllm"})
    foreign = foreign_argv(vllm, model_path="/models/m", port=8000, host="127.0.0.1")
    assert not {"--profile", "--profile-h100", "--cold-start"} & set(foreign)


# ----------------------------------------------------------------- /metrics


def engine_metrics_text(stats: EngineStats) -> str:
    """What a replica's /metrics returns, made by the engine server's own registry."""
    m = ServerMetrics("chat")
    m.stats = lambda: stats
    m.ttft.observe(0.1)
    m.prompt_len.observe(40)
    m.finished("stop")
    return generate_latest(m.registry).decode()


def test_parse_engine_metrics() -> None:
    text = engine_metrics_text(
        EngineStats(
            num_running=3, num_waiting=2, kv_cache_usage=0.25, generation_tokens=1234, prompt_tokens=99
        )
    )
    assert parse_metrics(text) == EngineSample(
        running=3,
        waiting=2,
        kv_cache_usage=0.25,
        generation_tokens=1234,
        prompt_tokens=99,
        ttft_sum=pytest.approx(0.1),
        ttft_count=1,
        # The prompt-length histogram, cumulative by bound: the 40-token prompt from 64 on.
        prompt_buckets=(*((le, float(le >= 40)) for le in PROMPT_TOKEN_BUCKETS), (math.inf, 1.0)),
    )
    assert parse_metrics("") == EngineSample()


def test_load_tracker_rate_and_counter_reset() -> None:
    t = LoadTracker(window_s=3.0)
    assert t.update(EngineSample(generation_tokens=100), 10.0).tokens_per_s == 0.0
    load = t.update(EngineSample(running=2, waiting=1, kv_cache_usage=0.5, generation_tokens=150), 11.0)
    assert (load.running, load.waiting, load.kv_cache_usage, load.tokens_per_s) == (2, 1, 0.5, 50.0)
    assert t.update(EngineSample(generation_tokens=250), 12.0).tokens_per_s == 75.0
    # the window slides: 10 s is dropped once 11 s is 3 s old
    assert t.update(EngineSample(generation_tokens=250), 14.0).tokens_per_s == pytest.approx(100 / 3)
    assert t.update(EngineSample(generation_tokens=5), 15.0).tokens_per_s == 0.0  # replica restarted
    assert t.update(EngineSample(generation_tokens=25), 16.0).tokens_per_s == 20.0


def test_load_tracker_reports_work_prompt_tokens_requests_and_ttft() -> None:
    t = LoadTracker(window_s=3.0)
    assert t.update(EngineSample(prompt_tokens=1000, ttft_sum=2.0, ttft_count=10), 10.0).ttft_s is None
    load = t.update(EngineSample(prompt_tokens=5000, ttft_sum=3.5, ttft_count=13), 12.0)
    assert load.prompt_tokens_per_s == 2000 and load.requests_per_s == 1.5
    assert load.ttft_s == pytest.approx(0.5)  # the 3 requests that started: 1.5 s of TTFT


# ----------------------------------------------------------------- inventory

NVIDIA_SMI = """name, memory.total [MiB]
NVIDIA H100 80GB HBM3, 81559 MiB
NVIDIA H100 80GB HBM3, 81559 MiB
NVIDIA L4, 23034 MiB
"""


def test_parse_nvidia_smi_groups_by_model() -> None:
    gpus = parse_nvidia_smi(NVIDIA_SMI)
    assert gpus == [("H100 80GB HBM3", 79.6), ("H100 80GB HBM3", 79.6), ("L4", 22.5)]
    assert parse_nvidia_smi("NVIDIA L4, 23034\n") == [("L4", 22.5)]
    pools = gpu_pools(gpus)
    assert [(p.name, p.gpu_model, p.gpus_per_node, p.gpu_memory_gb) for p in pools] == [
        ("gpu-h100-80gb-hbm3", "H100 80GB HBM3", 2, 79.6),
        ("gpu-l4", "L4", 1, 22.5),
    ]


def test_inventory_declared_pools_win(tmp_path: Path) -> None:
    declared = PoolInventory(name="a100", gpu_model="A100", gpus_per_node=8, nodes=4, tier=Tier.spot)
    cfg = ClusterConfig(cluster="c1", state_dir=tmp_path, pools=[declared])
    assert inventory(cfg) == [declared]


def test_cpu_pool(tmp_path: Path) -> None:
    cfg = ClusterConfig(cluster="c1", state_dir=tmp_path, cpu_slots=3)
    pool = cpu_pool(cfg)
    assert (pool.name, pool.gpu_model, pool.gpus_per_node, pool.nodes, pool.tier, pool.hourly_price) == (
        "cpu", "cpu", 3, 1, Tier.reserved, 0.0,
    )  # fmt: skip
