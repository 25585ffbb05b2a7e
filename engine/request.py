"""One sequence the engine is generating: its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from fleet_base.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # eos, stop token or stop string
    FINISHED_LENGTH = 4  # max_tokens or the context window
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    """State of one sequence. `num_computed_tokens` counts tokens whose KV is in the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower value = more important (vLLM convention)
    arrival_time: float = field(default_factory=time.monotonic)
    # Extra prefix-cache key (e.g. a LoRA adapter id): equal tokens under another key never match.
    cache_salt: str | None = None
    eos_token_id: int | None = None
    max_model_len: int = 2048
    lora: Any = None  # engine.lora.LoRAAdapter this sequence runs under (None = the base model)

    output_token_ids: list[int] = field(default_factory=list)
    # Speculative drafts to verify after the last token this step (engine.spec_decode); not
    # part of the sequence's tokens until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: Any = None  # torch.Generator for seeded sampling, created by the runner
    grammar: Any = None  # xgrammar matcher of a structured-output sequence
    pool_sum: Any = None  # embedding requests: running sum of the prompt's hidden states
    embedding: list[float] | None = None
    # Timestamps (time.monotonic) for latency metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def pooling(self) -> bool:
        return self.sampling_params.pooling is not None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
