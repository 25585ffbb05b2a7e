"""The metric names of llm-d's model-server protocol (gateway-api-inference-extension,
docs/proposals/003-model-server-protocol), exported beside Fleet's own so that an llm-d or
Gateway API inference-extension endpoint picker can schedule onto this engine unchanged.

They are vLLM's names and semantics, read from the same `EngineStats` snapshot as Fleet's
`fleet_engine_*` gauges at each scrape, so the two always agree:

- `vllm:num_requests_waiting` = `fleet_engine_requests_waiting`
- `vllm:num_requests_running` = `fleet_engine_requests_running`
- `vllm:kv_cache_usage_perc` = `fleet_engine_kv_cache_usage_ratio` (a fraction in 0..1, as vLLM's)
- `vllm:lora_requests_info`: value the scrape's Unix time (the protocol's "last updated
  timestamp"), labels `running_lora_adapters` / `waiting_lora_adapters` (comma-separated
  adapter names of running / waiting requests) and `max_lora` (0 with LoRA disabled).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from engine.outputs import EngineStats

LORA_INFO = "vllm:lora_requests_info"


def protocol_families(s: EngineStats, model: str, now: Callable[[], float] = time.time) -> Iterator[Metric]:
    """The protocol's gauges of one stats snapshot (vLLM labels them `model_name`)."""

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model], value)
        return g

    yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting)
    yield gauge("vllm:num_requests_running", "Requests running on the engine now.", s.num_running)
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent).", s.kv_cache_usage)
    info = GaugeMetricFamily(
        LORA_INFO,
        "Running stats on LoRA requests; the value is the time of the last update.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric(
        [",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters), str(s.max_loras)], now()
    )
    yield info
