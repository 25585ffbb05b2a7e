"""Load of each ready replica, read from its Prometheus `/metrics` (see docs/metrics.md):
running and waiting sequences, KV-cache usage, and generated tokens/s as the rate of the
`fleet_engine_generation_tokens_total` counter between scrapes."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agent.protocol import ReplicaLoad

RUNNING = "fleet_engine_requests_running"
WAITING = "fleet_engine_requests_waiting"
KV_USAGE = "fleet_engine_kv_cache_usage_ratio"
GENERATED = "fleet_engine_generation_tokens_total"


@dataclass(frozen=True)
class EngineSample:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    generation_tokens: float = 0.0


def parse_metrics(text: str) -> EngineSample:
    """The engine's load gauges and token counter from Prometheus text, summed over the
    `model` label (one per replica today). Missing series read as zero."""
    values = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0, GENERATED: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += float(sample.value)
    return EngineSample(
        running=values[RUNNING],
        waiting=values[WAITING],
        kv_cache_usage=values[KV_USAGE],
        generation_tokens=values[GENERATED],
    )


class LoadTracker:
    """Turns successive samples of one replica into a `ReplicaLoad`; tokens/s over the
    last `window_s` (a counter that went down means a restart: the window starts over)."""

    def __init__(self, window_s: float = 3.0) -> None:
        self.window_s = window_s
        self._history: deque[tuple[float, float]] = deque()

    def update(self, sample: EngineSample, now: float) -> ReplicaLoad:
        if self._history and sample.generation_tokens < self._history[-1][1]:
            self._history.clear()
        self._history.append((now, sample.generation_tokens))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        (t0, c0), (t1, c1) = self._history[0], self._history[-1]
        rate = (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0
        return ReplicaLoad(
            running=round(sample.running),
            waiting=round(sample.waiting),
            kv_cache_usage=min(1.0, max(0.0, sample.kv_cache_usage)),
            tokens_per_s=max(0.0, rate),
        )


class MetricsScraper:
    """Scrapes replicas over HTTP and keeps one `LoadTracker` per replica id."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._trackers: dict[str, LoadTracker] = {}

    async def scrape(self, replica_id: str, url: str, now: float | None = None) -> ReplicaLoad | None:
        """The replica's load now, or None when /metrics did not answer sensibly."""
        try:
            r = await self._http.get(f"{url}/metrics")
            if r.status_code != 200:
                return None
            sample = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            return None
        tracker = self._trackers.setdefault(replica_id, LoadTracker())
        return tracker.update(sample, time.monotonic() if now is None else now)

    def forget(self, replica_id: str) -> None:
        self._trackers.pop(replica_id, None)

    async def close(self) -> None:
        await self._http.aclose()
