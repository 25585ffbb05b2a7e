"""Load of each ready replica, read from its Prometheus `/metrics` (see docs/metrics.md and,
for vLLM, SGLang and llama.cpp replicas, docs/engines.md): running and waiting sequences,
KV-cache usage, and as rates between scrapes: generated tokens/s
(`fleet_engine_generation_tokens_total`), admitted prompt tokens/s
(`fleet_engine_prompt_tokens_total`), requests starting per second and their mean TTFT
(`fleet_engine_time_to_first_token_seconds` count and sum), and the prompt lengths of the
requests that started, read from the increments of a prompt-length histogram
(`fleet_engine_request_prompt_tokens`, vLLM's `vllm:request_prompt_tokens`): the mix the SLO
policy's queue model needs, which no rate carries.

This is the one place an engine's series names become Fleet's: `SOURCES` lists, per
`EngineSample` field, the series of each engine that carries it."""

from __future__ import annotations

import math
import ssl
import time
from collections import deque
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet_base.bounds import MAX_TOKENS
from fleet_base.engines import CAPABILITIES, EngineKind
from fleet_base.protocol import ReplicaLoad
from fleet_base.quantiles import evenly_spaced

RUNNING = "fleet_engine_requests_running"
WAITING = "fleet_engine_requests_waiting"
KV_USAGE = "fleet_engine_kv_cache_usage_ratio"
GENERATED = "fleet_engine_generation_tokens_total"
PROMPT = "fleet_engine_prompt_tokens_total"
TTFT_SUM = "fleet_engine_time_to_first_token_seconds_sum"
TTFT_COUNT = "fleet_engine_time_to_first_token_seconds_count"
STARTUP = "fleet_engine_startup_seconds"  # {phase}: the replica's own cold-start parts
ENGINE_PHASES = ("load", "warmup", "first_token")


def _histogram(*families: str, part: str) -> tuple[str, ...]:
    return tuple(f"{f}_{part}" for f in families)


_TTFT = (
    "fleet_engine_time_to_first_token_seconds",
    "vllm:time_to_first_token_seconds",
    "sglang:time_to_first_token_seconds",
)
# vLLM and SGLang renamed time_per_output_token to inter_token_latency; either may be served.
_ITL = (
    "fleet_engine_inter_token_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)

# Per EngineSample field, the series that carry it, Fleet's first. A scrape reads the first of
# them it contains (summed over its label sets), so an engine that serves two names for one
# quantity (Fleet's engine with llm-d's `vllm:*` names; vLLM with a deprecated name next to
# its successor) is counted once. vLLM's `*_perc` gauges are ratios in [0, 1].
SOURCES: dict[str, tuple[str, ...]] = {
    "running": (
        RUNNING,
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
        "llamacpp:requests_processing",
    ),
    "waiting": (
        WAITING,
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
        "llamacpp:requests_deferred",
    ),
    "kv_cache_usage": (
        KV_USAGE,
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    ),
    "generation_tokens": (
        GENERATED,
        "vllm:generation_tokens_total",
        "sglang:generation_tokens_total",
        "llamacpp:tokens_predicted_total",
    ),
    "prompt_tokens": (
        PROMPT,
        "vllm:prompt_tokens_total",
        "sglang:prompt_tokens_total",
        "llamacpp:prompt_tokens_total",
    ),
    "ttft_sum": _histogram(*_TTFT, part="sum"),
    "ttft_count": _histogram(*_TTFT, part="count"),
    # llama.cpp has no latency histogram: its decode seconds over decoded tokens is the mean ITL.
    "itl_sum": (*_histogram(*_ITL, part="sum"), "llamacpp:tokens_predicted_seconds_total"),
    "itl_count": (*_histogram(*_ITL, part="count"), "llamacpp:tokens_predicted_total"),
    "prefix_cache_hits": (
        "fleet_engine_prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_hits_total",
    ),
    "prefix_cache_queries": (
        "fleet_engine_prefix_cache_queries_total",
        "vllm:prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_queries_total",
    ),
    # Engines that only publish a hit-rate gauge, not hit and query counters.
    "prefix_cache_hit_rate": ("sglang:cache_hit_rate", "vllm:gpu_prefix_cache_hit_rate"),
}
# Histograms of each request's prompt tokens, Fleet's first (llama.cpp and SGLang serve none
# by default: their replicas report no mix, and the policy assumes one).
PROMPT_LENGTHS = ("fleet_engine_request_prompt_tokens", "vllm:request_prompt_tokens")
PROMPT_SAMPLE = 16  # prompt lengths a replica reports per heartbeat, at most
# Ratios of one pool: the fullest label set (a data-parallel rank) stands for the replica.
_RATIOS = frozenset({"kv_cache_usage", "prefix_cache_hit_rate"})
_SOURCE_NAMES = frozenset(n for names in SOURCES.values() for n in names)


@dataclass(frozen=True)
class EngineSample:
    """One scrape of a replica, in Fleet's terms whatever engine it runs. Counters are
    cumulative; `prefix_cache_hit_rate` is None unless the engine only publishes a gauge."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    startup: tuple[tuple[str, float], ...] = ()
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prefix_cache_hits: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hit_rate: float | None = None
    # Cumulative counts of the prompt-length histogram: (upper bound, count), by bound.
    prompt_buckets: tuple[tuple[float, float], ...] = ()


def engine_sources(engine: EngineKind | None) -> dict[str, tuple[str, ...]]:
    """`SOURCES` as read from a replica of `engine`: only its own series (a foreign engine's
    scrape never picks up another engine's names); Fleet's engine and None read them all,
    Fleet's names first."""
    if engine is None or engine == "fleet":
        return SOURCES
    return {field: _own(names, engine) for field, names in SOURCES.items()}


def _own(names: tuple[str, ...], engine: EngineKind | None) -> tuple[str, ...]:
    """Of `names`, those a replica of `engine` serves (all of them for Fleet's engine)."""
    if engine is None or engine == "fleet":
        return names
    prefix = CAPABILITIES[engine].metrics_prefix
    return tuple(n for n in names if n.startswith(prefix))


def parse_metrics(text: str, engine: EngineKind | None = None) -> EngineSample:
    """The engine's load gauges and counters from Prometheus text, summed over label sets
    (`model`, vLLM's `engine`, SGLang's ranks); ratios take the largest. Missing series read
    as zero."""
    sources = engine_sources(engine)
    seen: dict[str, list[float]] = {}
    startup: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}  # histogram -> upper bound -> count
    histograms = _own(PROMPT_LENGTHS, engine)
    wanted = {f"{h}_bucket": h for h in histograms}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SOURCE_NAMES:
                seen.setdefault(sample.name, []).append(float(sample.value))
            elif sample.name == STARTUP and sample.labels.get("phase") in ENGINE_PHASES:
                startup[sample.labels["phase"]] = float(sample.value)
            elif sample.name in wanted and "le" in sample.labels:
                try:
                    le = float(sample.labels["le"])
                except ValueError:  # a malformed bound drops that bucket, not the replica's load
                    continue
                if math.isnan(le):
                    continue
                mine = buckets.setdefault(wanted[sample.name], {})
                mine[le] = mine.get(le, 0.0) + float(sample.value)
    fields: dict[str, float] = {}
    for field, names in sources.items():
        values = next((seen[n] for n in names if n in seen), None)
        if values is not None:
            fields[field] = max(values) if field in _RATIOS else sum(values)
    prompts = next((buckets[h] for h in histograms if h in buckets), {})
    return EngineSample(
        startup=tuple(sorted(startup.items())), prompt_buckets=tuple(sorted(prompts.items())), **fields
    )


def prompt_sample(
    before: tuple[tuple[float, float], ...], after: tuple[tuple[float, float], ...], size: int = PROMPT_SAMPLE
) -> tuple[int, ...]:
    """Up to `size` prompt lengths spread like those of the requests counted between two
    readings of a cumulative prompt-length histogram: evenly spaced quantiles, each at its
    bucket's geometric middle (the first bucket's half, the open last bucket's double).
    Empty when nothing was counted, or the buckets changed (a restart, another engine), or
    the counts are not finite. Lengths are bounded to 1 .. MAX_TOKENS (a bogus bound)."""
    if not after or (before and [b for b, _ in before] != [b for b, _ in after]):
        return ()
    start = dict(before)
    counts = [(le, c - start.get(le, 0.0)) for le, c in after]
    total = counts[-1][1]
    if not all(math.isfinite(c) and c >= 0 for _, c in counts) or total < 1:
        return ()
    buckets, lo, below = [], 0.0, 0.0  # (geometric middle, requests in the bucket)
    for le, c in counts:
        mid = 2 * lo if math.isinf(le) else (math.sqrt(lo * le) if lo > 0 else le / 2)
        buckets.append((mid, c - below))
        lo, below = (lo if math.isinf(le) else le), c
    picked = evenly_spaced(buckets, min(size, int(total)))
    return tuple(round(min(MAX_TOKENS, max(1.0, x))) for x in picked)


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
            prompt_sample=prompt_sample(a.prompt_buckets, b.prompt_buckets) if a is not b else (),
        )


class MetricsScraper:
    """Scrapes replicas over HTTP and keeps one `LoadTracker` per replica id. `headers`: the
    replica token (Fleet's engine serves /metrics openly; llama-server only with the key)."""

    def __init__(
        self,
        timeout_s: float = 2.0,
        verify: ssl.SSLContext | bool = True,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._http = httpx.AsyncClient(
            timeout=timeout_s, verify=verify, headers=headers
        )  # verify: the fleet CA
        self._trackers: dict[str, LoadTracker] = {}
        self._startup: dict[str, dict[str, float]] = {}

    async def scrape(
        self, replica_id: str, url: str, now: float | None = None, engine: EngineKind | None = None
    ) -> ReplicaLoad | None:
        """The replica's load now, or None when /metrics did not answer sensibly."""
        try:
            r = await self._http.get(f"{url}/metrics")
            if r.status_code != 200:
                return None
            sample = parse_metrics(r.text, engine)
        except (httpx.HTTPError, ValueError):
            return None
        self._startup[replica_id] = dict(sample.startup)
        tracker = self._trackers.setdefault(replica_id, LoadTracker())
        try:
            return tracker.update(sample, time.monotonic() if now is None else now)
        except (ValueError, OverflowError):  # figures no load can hold (NaN, out of bounds)
            return None

    def startup(self, replica_id: str) -> dict[str, float]:
        """The load/warmup/first_token seconds the replica last reported of its own start."""
        return self._startup.get(replica_id, {})

    def forget(self, replica_id: str) -> None:
        self._trackers.pop(replica_id, None)
        self._startup.pop(replica_id, None)

    async def close(self) -> None:
        await self._http.aclose()
