"""llm-d's model-server protocol names on our engine's /metrics: the units of the exposition,
then a real replica scraped under load (more streams than `--max-num-seqs`, so some wait),
read with Prometheus' own text parser."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from engine.outputs import EngineStats
from engine.server.process import ServerProcess
from engine.server.protocol_metrics import LORA_INFO, protocol_families
from tests.polling import wait_for

MODEL = "smol-protocol"
MAX_SEQS = 2
STREAMS = 5


def _parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _one(samples: dict, name: str, **labels: str) -> float:
    found = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {samples.get(name)}"
    return found[0]


class _Fixed(Collector):
    def __init__(self, s: EngineStats) -> None:
        self.s = s

    def collect(self):
        return protocol_families(self.s, "m", now=lambda: 1700000000.0)


@pytest.mark.parametrize(
    ("stats", "running", "waiting", "max_lora"),
    [
        (EngineStats(), "", "", "0"),
        (
            EngineStats(
                num_running=3,
                num_waiting=7,
                kv_cache_usage=0.625,
                running_lora_adapters=("sql", "zh"),
                waiting_lora_adapters=("fr",),
                max_loras=4,
            ),
            "sql,zh",
            "fr",
            "4",
        ),
    ],
)
def test_exposition_follows_the_protocol(
    stats: EngineStats, running: str, waiting: str, max_lora: str
) -> None:
    registry = CollectorRegistry()
    registry.register(_Fixed(stats))
    samples = _parse(generate_latest(registry).decode())
    assert _one(samples, "vllm:num_requests_waiting", model_name="m") == stats.num_waiting
    assert _one(samples, "vllm:num_requests_running", model_name="m") == stats.num_running
    assert _one(samples, "vllm:kv_cache_usage_perc", model_name="m") == stats.kv_cache_usage
    [(labels, value)] = samples[LORA_INFO]
    assert labels == {
        "running_lora_adapters": running,
        "waiting_lora_adapters": waiting,
        "max_lora": max_lora,
    }
    assert value == 1700000000.0


@pytest.fixture(scope="module")
def replica(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("engine-server-protocol") / "server.log"
    proc = ServerProcess(
        "--max-num-seqs", str(MAX_SEQS), "--max-model-len", "1024", "--served-model-name", MODEL,
        log_path=log,
    )  # fmt: skip
    with proc:
        yield proc


@pytest.mark.slow
def test_protocol_names_under_load_equal_fleets_own(replica: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def stream() -> None:
        with (
            httpx.Client(base_url=replica.url, timeout=300) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=replica.url, timeout=30) as c:

            def loaded() -> dict | None:
                samples = _parse(c.get("/metrics").text)
                return samples if _one(samples, "vllm:num_requests_waiting", model_name=MODEL) > 0 else None

            samples = wait_for(loaded, 120, "requests to queue behind --max-num-seqs", 0.05)
    finally:
        stop.set()
    waiting = _one(samples, "vllm:num_requests_waiting", model_name=MODEL)
    running = _one(samples, "vllm:num_requests_running", model_name=MODEL)
    usage = _one(samples, "vllm:kv_cache_usage_perc", model_name=MODEL)
    assert 0 < waiting <= STREAMS - 1
    assert 1 <= running <= MAX_SEQS
    assert 0 < usage <= 1
    assert waiting == _one(samples, "fleet_engine_requests_waiting", model=MODEL)
    assert running == _one(samples, "fleet_engine_requests_running", model=MODEL)
    assert usage == _one(samples, "fleet_engine_kv_cache_usage_ratio", model=MODEL)
    [(labels, stamp)] = samples[LORA_INFO]
    assert labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}
    assert stamp > 1.7e9
    for t in threads:
        t.join(60)
