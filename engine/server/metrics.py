"""Prometheus metrics of one replica, in a registry of its own (see docs/metrics.md).

Engine-wide gauges and counters are read from `engine.stats()` at scrape time, so they can
never drift from the engine (llm-d's `vllm:*` protocol names too, see `protocol_metrics`);
latency histograms and finish reasons are observed per request from the outputs the server
streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import EngineStats, RequestOutput
from engine.server.protocol_metrics import protocol_families
from engine.timing import HistogramSnapshot
from fleet_base.listener import RefusalCollector
from fleet_base.metric_buckets import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    PROMPT_TOKEN_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
)


class _EngineStatsCollector(Collector):
    """Turns one `EngineStats` snapshot per scrape into gauges and counters."""

    def __init__(self, model: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model = model
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats() or EngineStats()
        labels = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(labels, value)
            return c

        yield gauge("fleet_engine_requests_running", "Sequence groups being generated now.", s.num_running)
        yield gauge("fleet_engine_requests_waiting", "Requests queued for admission.", s.num_waiting)
        yield gauge(
            "fleet_engine_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (0..1).",
            s.kv_cache_usage,
        )
        yield counter("fleet_engine_prompt_tokens", "Prompt tokens processed.", s.prompt_tokens)
        yield counter("fleet_engine_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter(
            "fleet_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "fleet_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield counter(
            "fleet_engine_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions
        )
        aborted = CounterMetricFamily(
            "fleet_engine_requests_aborted",
            "Requests the engine aborted by reason (slow_reader: the client left more output "
            "unread than --max-unread-bytes).",
            labels=["model", "reason"],
        )
        aborted.add_metric([self.model, "slow_reader"], s.num_aborted_slow_reader)
        yield aborted
        yield counter(
            "fleet_engine_spec_decode_num_drafts",
            "Speculative chunks verified (one per sequence per step that had drafts).",
            s.spec_decode_num_drafts,
        )
        yield counter(
            "fleet_engine_spec_decode_num_draft_tokens",
            "Speculative draft tokens verified.",
            s.spec_decode_num_draft_tokens,
        )
        yield counter(
            "fleet_engine_spec_decode_num_accepted_tokens",
            "Speculative draft tokens the target model accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        yield counter(
            "fleet_engine_spec_decode_num_gated_steps",
            "Steps not drafted because the decoding batch reached disable_by_batch_size.",
            s.spec_decode_num_gated_steps,
        )
        yield counter(
            "fleet_engine_spec_decode_num_backoff_skips",
            "Sequence-steps not drafted because the sequence's recent drafts were all rejected.",
            s.spec_decode_num_backoff_skips,
        )
        failures = CounterMetricFamily(
            "fleet_engine_step_failures",
            "Steps whose model run failed: isolated (only the requests that made it fail failed), "
            "recovered (run again in parts, nothing failed), escalated (no request to blame).",
            labels=["model", "outcome"],
        )
        for outcome in ("isolated", "recovered", "escalated"):
            failures.add_metric([self.model, outcome], s.step_failures.get(outcome, 0))
        yield failures
        hits = CounterMetricFamily(
            "fleet_engine_kv_tier_hits",
            "Prefix blocks found at admission, by the KV tier that held them (host: loaded back "
            "from the host tier instead of recomputed).",
            labels=["model", "tier"],
        )
        for tier in ("device", "host"):
            hits.add_metric([self.model, tier], s.kv_tier_hits.get(tier, 0))
        yield hits
        moved = CounterMetricFamily(
            "fleet_engine_kv_tier_bytes",
            "KV bytes copied between the device cache and the host tier (offload: evicted blocks "
            "kept; load: host hits copied back).",
            labels=["model", "direction"],
        )
        for direction in ("offload", "load"):
            moved.add_metric([self.model, direction], s.kv_tier_bytes.get(direction, 0))
        yield moved
        yield histogram_family(
            "fleet_engine_kv_tier_load_seconds",
            "Copying one step's host-tier hits back to the device (on CUDA: queuing the "
            "asynchronous copies).",
            self.model,
            s.kv_tier_load_seconds,
        )
        yield from protocol_families(s, self.model)  # the same snapshot: the two always agree


def histogram_family(name: str, doc: str, model: str, snap: HistogramSnapshot | None) -> Metric:
    """A Prometheus histogram of the engine's own `HistogramSnapshot` (empty when None)."""
    h = HistogramMetricFamily(name, doc, labels=["model"])
    if snap is None:
        h.add_metric([model], [("+Inf", 0)], 0.0)
        return h
    cumulative, buckets = 0, []
    for bound, count in zip((*snap.buckets, float("inf")), snap.counts):
        cumulative += count
        buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
    h.add_metric([model], buckets, snap.total)
    return h


_GRAMMAR_HISTOGRAMS = {
    "compile": (
        "fleet_engine_grammar_compile_seconds",
        "Compiling a JSON schema to a token grammar (cache misses only; hits cost nothing).",
    ),
    "mask": (
        "fleet_engine_grammar_mask_seconds",
        "Filling one step's token bitmask for every constrained sequence of the batch (one batched call).",
    ),
}


class _GrammarCollector(Collector):
    """Grammar timings from the engine's own histograms, read at scrape time."""

    def __init__(self, model: str, timings: Callable[[], dict[str, HistogramSnapshot]]) -> None:
        self.model = model
        self.timings = timings

    def collect(self) -> Iterable[Metric]:
        snaps = self.timings()
        for key, (name, doc) in _GRAMMAR_HISTOGRAMS.items():
            yield histogram_family(name, doc, self.model, snaps.get(key))


STARTUP_METRIC = "fleet_engine_startup_seconds"
STARTUP_PHASES = ("pull", "load", "warmup", "first_token")


class _StartupCollector(Collector):
    """`fleet_engine_startup_seconds{model,phase}`: the parts of this replica's cold start
    it measured itself (pull: fetching a model URI it found uncached; load: weights to
    device and KV cache; warmup: one token generated before reporting ready; first_token:
    the first real request's time to first token). A phase not reached is absent."""

    def __init__(self, model: str, phases: dict[str, float]) -> None:
        self.model = model
        self.phases = phases

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily(STARTUP_METRIC, "Seconds of each part of this replica's cold start.",
                              labels=["model", "phase"])  # fmt: skip
        for phase in STARTUP_PHASES:
            if phase in self.phases:
                g.add_metric([self.model, phase], self.phases[phase])
        yield g


class ServerMetrics:
    """The replica's registry: engine snapshot collector plus per-request histograms."""

    def __init__(self, model: str) -> None:
        self.model = model
        # phase -> seconds, filled by the launcher (pull, load, warmup) and the first request.
        self.startup: dict[str, float] = {}
        # Set once the engine exists; until then the engine metrics read as zero.
        self.stats: Callable[[], EngineStats | None] = lambda: None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model, lambda: self.stats()))
        self.registry.register(_StartupCollector(model, self.startup))
        self.registry.register(RefusalCollector())
        r = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, ["model"], registry=r, buckets=buckets).labels(model)

        self.ttft = histogram(
            "fleet_engine_time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "fleet_engine_inter_token_latency_seconds",
            "Time between successive tokens of a sequence.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "fleet_engine_e2e_request_latency_seconds", "Arrival to the last token of a request.", E2E_BUCKETS
        )
        self.prompt_len = histogram(
            "fleet_engine_request_prompt_tokens",
            "Prompt tokens of each request, observed at its first token (the autoscaler's prompt mix).",
            PROMPT_TOKEN_BUCKETS,
        )
        self.queue = histogram(
            "fleet_engine_request_queue_time_seconds",
            "Arrival to first scheduled (time waiting in the queue).",
            QUEUE_BUCKETS,
        )
        self._finished = Counter(
            "fleet_engine_requests",
            "Finished sequences by finish reason (stop, length, abort).",
            ["model", "finish_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self._finished.labels(model, reason)
        self._api = Counter(
            "fleet_engine_api_requests",
            "API requests admitted past validation, by endpoint and by what shapes the output "
            "(text, json_object, json_schema, tools_auto, tools_required, tools_named, embedding).",
            ["model", "endpoint", "feature"],
            registry=r,
        )
        # Set once the engine exists: grammar compile / mask-fill durations (engine.timing).
        self.grammar_timings: Callable[[], dict[str, HistogramSnapshot]] = dict
        self.registry.register(_GrammarCollector(model, lambda: self.grammar_timings()))

        self._lora_load = histogram(
            "fleet_engine_lora_load_seconds",
            "Reading and checking one LoRA adapter (start-up or POST /v1/load_lora_adapter).",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self._lora_adapters = Gauge(
            "fleet_engine_lora_adapters", "LoRA adapters loaded on this replica.", ["model"], registry=r
        ).labels(model)
        self._lora_requests = Counter(
            "fleet_engine_lora_requests",
            "API requests admitted per LoRA adapter (the base model is not counted).",
            ["model", "adapter"],
            registry=r,
        )

    def lora_loaded(self, seconds: float, num_loaded: int) -> None:
        self._lora_load.observe(seconds)
        self._lora_adapters.set(num_loaded)

    def lora_unloaded(self, num_loaded: int) -> None:
        self._lora_adapters.set(num_loaded)

    def lora_request(self, adapter: str) -> None:
        self._lora_requests.labels(self.model, adapter).inc()

    def api_request(self, endpoint: str, feature: str) -> None:
        self._api.labels(self.model, endpoint, feature).inc()

    def observer(self) -> RequestObserver:
        return RequestObserver(self)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model, reason).inc()


class RequestObserver:
    """Observes one engine request's stream: TTFT, inter-token gaps, queue and e2e time.

    Engine timestamps are used where the output carries them; token gaps are measured where
    the tokens arrive (the server), divided evenly when one step delivers several tokens.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.start = time.monotonic()
        self.last: float | None = None
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        new = max((len(o.delta_token_ids) for o in out.outputs), default=0)
        if new:
            if self.last is None:
                ttft = out.metrics.ttft if out.metrics is not None else None
                self.m.ttft.observe(ttft if ttft is not None else now - self.start)
                self.m.prompt_len.observe(len(out.prompt_token_ids))
                self.m.startup.setdefault(
                    "first_token", round(ttft if ttft is not None else now - self.start, 4)
                )
            else:
                gap = (now - self.last) / new
                for _ in range(new):
                    self.m.itl.observe(gap)
            self.last = now
        if out.finished:
            self.finish(out)

    def finish(self, out: RequestOutput) -> None:
        if self.done:
            return
        self.done = True
        now = time.monotonic()
        mt = out.metrics
        if mt is not None and mt.queue_time is not None:
            self.m.queue.observe(mt.queue_time)
        end = (mt.finished_time or mt.last_token_time) if mt is not None else None
        self.m.e2e.observe(end - mt.arrival_time if mt is not None and end is not None else now - self.start)
        for o in out.outputs:
            self.m.finished(o.finish_reason or "abort")

    def abandon(self, num_sequences: int) -> None:
        """The stream ended without a finished output (client gone, engine aborted)."""
        if self.done:
            return
        self.done = True
        self.m.e2e.observe(time.monotonic() - self.start)
        for _ in range(num_sequences):
            self.m.finished("abort")
