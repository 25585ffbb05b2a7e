"""Load of each ready replica, read from its Prometheus `/metrics` (see docs/metrics.md):
running and waiting sequences, KV-cache usage, and as rates between scrapes: generated
tokens/s (`fleet_engine_generation_tokens_total`), admitted prompt tokens/s
(`fleet_engine_prompt_tokens_total`), requests starting per second and their mean TTFT
(`fleet_engine_time_to_first_token_seconds` count and sum)."""

from __future__ import annotations

import ssl
import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet_base.protocol import ReplicaLoad

RUNNING = "fleet_engine_requests_running"
WAITING = "fleet_engine_requests_waiting"
KV_USAGE = "fleet_engine_kv_cache_usage_ratio"
GENERATED = "fleet_engine_generation_tokens_total"
PROMPT = "fleet_engine_prompt_tokens_total"
TTFT_SUM = "fleet_engine_time_to_first_token_seconds_sum"
TTFT_COUNT = "fleet_engine_time_to_first_token_seconds_count"
STARTUP = "fleet_engine_startup_seconds"  # {phase}: the replica's own cold-start parts
ENGINE_PHASES = ("load", "warmup", "first_token")


@dataclass(frozen=True)
class EngineSample:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    startup: tuple[tuple[str, float], ...] = ()


def parse_metrics(text: str) -> EngineSample:
    """The engine's load gauges and token counter from Prometheus text, summed over the
    `model` label (one per replica today). Missing series read as zero."""
    values = dict.fromkeys((RUNNING, WAITING, KV_USAGE, GENERATED, PROMPT, TTFT_SUM, TTFT_COUNT), 0.0)
    startup: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += float(sample.value)
            elif sample.name == STARTUP and sample.labels.get("phase") in ENGINE_PHASES:
                startup[sample.labels["phase"]] = float(sample.value)
    return EngineSample(
        running=values[RUNNING],
        waiting=values[WAITING],
        kv_cache_usage=values[KV_USAGE],
        generation_tokens=values[GENERATED],
        prompt_tokens=values[PROMPT],
        ttft_sum=values[TTFT_SUM],
        ttft_count=values[TTFT_COUNT],
        startup=tuple(sorted(startup.items())),
    )


class LoadTracker:
    """Turns successive samples of one replica into a `ReplicaLoad`; tokens/s over the
    last `window_s` (a counter that went down means a restart: the window starts over)."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._history: deque[tuple[float, EngineSample]] = deque()

    def update(self, sample: EngineSample, now: float) -> ReplicaLoad:
        if self._history and sample.generation_tokens < self._history[-1][1].generation_tokens:
            self._history.clear()
        self._history.append((now, sample))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        (t0, a), (t1, b) = self._history[0], self._history[-1]
        dt = t1 - t0

        def rate(x: float, y: float) -> float:
            return max(0.0, (y - x) / dt) if dt > 0 else 0.0

        started = b.ttft_count - a.ttft_count
        return ReplicaLoad(
            running=round(sample.running),
            waiting=round(sample.waiting),
            kv_cache_usage=min(1.0, max(0.0, sample.kv_cache_usage)),
            tokens_per_s=rate(a.generation_tokens, b.generation_tokens),
            prompt_tokens_per_s=rate(a.prompt_tokens, b.prompt_tokens),
            requests_per_s=rate(a.ttft_count, b.ttft_count),
            ttft_s=(b.ttft_sum - a.ttft_sum) / started if started > 0 else None,
        )


class MetricsScraper:
    """Scrapes replicas over HTTP and keeps one `LoadTracker` per replica id."""

    def __init__(self, timeout_s: float = 2.0, verify: ssl.SSLContext | bool = True) -> None:
        self._http = httpx.AsyncClient(timeout=timeout_s, verify=verify)  # verify: the fleet CA
        self._trackers: dict[str, LoadTracker] = {}
        self._startup: dict[str, dict[str, float]] = {}

    async def scrape(self, replica_id: str, url: str, now: float | None = None) -> ReplicaLoad | None:
        """The replica's load now, or None when /metrics did not answer sensibly."""
        try:
            r = await self._http.get(f"{url}/metrics")
            if r.status_code != 200:
                return None
            sample = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            return None
        self._startup[replica_id] = dict(sample.startup)
        tracker = self._trackers.setdefault(replica_id, LoadTracker())
        return tracker.update(sample, time.monotonic() if now is None else now)

    def startup(self, replica_id: str) -> dict[str, float]:
        """The load/warmup/first_token seconds the replica last reported of its own start."""
        return self._startup.get(replica_id, {})

    def forget(self, replica_id: str) -> None:
        self._trackers.pop(replica_id, None)
        self._startup.pop(replica_id, None)

    async def close(self) -> None:
        await self._http.aclose()
