"""What the engine hands back: per-request outputs, per-token logprobs and engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.timing import HistogramSnapshot


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token's text (bytes that are not valid UTF-8 alone are shown as "bytes:\\xNN")
    logprob: float


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token and the top alternatives at that step."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class RequestMetrics:
    """Timestamps on the time.monotonic clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence. `delta_*` is what is new since the previous output of the
    same request. The cumulative `text`/`token_ids`/`logprobs` are filled on a request's
    final output only (`RequestOutput.finished`); a streamed request's earlier outputs
    leave them empty, so each output costs what it adds, not everything generated so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[SampleLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0  # times its sequences were preempted (their KV recomputed later)
    embedding: list[float] | None = None  # embedding requests (SamplingParams.pooling)

    # The single-sequence view the offline API promises.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


# Rough Python memory of one queued output, for the bound on what a replica holds for a
# client that does not read (`AsyncLLM`): the objects themselves, then per character,
# token id and logprob entry (measured with tracemalloc on outputs as the engine builds them).
_OUTPUT_BYTES = 500
_COMPLETION_BYTES = 350
_TOKEN_BYTES = 40
_LOGPROB_ENTRY_BYTES = 200


def approx_bytes(out: RequestOutput) -> int:
    """An estimate of the memory `out` holds (cumulative fields included)."""
    size = _OUTPUT_BYTES
    for o in out.outputs:
        size += _COMPLETION_BYTES + len(o.text) + len(o.delta_text)
        size += _TOKEN_BYTES * (len(o.token_ids) + len(o.delta_token_ids))
        for lps in (o.logprobs, o.delta_logprobs):
            size += sum(_LOGPROB_ENTRY_BYTES * (1 + len(lp.top)) for lp in lps or ())
    return size


@dataclass
class EngineStats:
    """A snapshot for /metrics and heartbeats; counters are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found in the cache
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Speculative decoding: chunks verified, draft tokens in them, and drafts accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Steps the batch-size gate kept undrafted, and sequence-steps skipped by backoff.
    spec_decode_num_gated_steps: int = 0
    spec_decode_num_backoff_skips: int = 0
    # Steps whose model run failed, by outcome: isolated (only the requests that made it
    # fail failed), recovered (run again in parts, nothing failed), escalated (no request
    # to blame: every request of the step failed).
    step_failures: dict[str, int] = field(default_factory=dict)
    # Requests aborted because their consumer left too much output unread (AsyncLLM).
    num_aborted_slow_reader: int = 0
    # The KV tiers: blocks hit per tier ("device", "host") at admission, bytes moved per
    # direction ("offload", "load"), and the time of each step's loads (None: no host tier).
    kv_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_tier_bytes: dict[str, int] = field(default_factory=dict)
    kv_tier_load_seconds: HistogramSnapshot | None = None
    # LoRA: the adapters of running and of waiting requests, and the most adapters one batch
    # may hold (0: LoRA disabled).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0
