"""What the server knows about its engine and its own lifecycle (loading, ready, draining)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from engine.outputs import EngineStats, RequestOutput
from engine.server.metrics import ServerMetrics
from fleet_base.sampling_params import SamplingParams


class EngineClient(Protocol):
    """The part of `engine.AsyncLLM` the server uses (tests may pass anything shaped like it)."""

    tokenizer: Any
    max_model_len: int
    model_config: Any

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        *,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


class ServerSettings(BaseModel):
    """Server-side knobs (the engine's own knobs live in `engine.config.EngineArgs`)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = Field(1 << 20, ge=1024)
    # /health says "stalled" (503) once the engine loop has had work and made no step for
    # this long, so the agent restarts the replica.
    stall_timeout_s: float = Field(60.0, gt=0)
    # Test hooks (POST /debug/freeze, /debug/thaw, /debug/corrupt, /debug/uncorrupt); never on in production.
    test_hooks: bool = False
    drain_timeout: float = Field(30.0, ge=0.0)
    # A draining replica hands the streams a gateway can continue elsewhere over after this
    # long (engine.server.continuation), instead of cutting them at drain_timeout.
    drain_handover_s: float = Field(5.0, ge=0.0)
    retry_after_s: int = Field(1, ge=1)
    # /v1/embeddings: how the last hidden state becomes one vector per input
    embedding_pooling: Literal["mean", "last"] = "mean"
    embedding_normalize: bool = True


@dataclass
class ServerState:
    """Mutable lifecycle state shared by the app, its middleware and the launcher."""

    settings: ServerSettings
    metrics: ServerMetrics
    engine: EngineClient | None = None
    load_error: str | None = None
    draining: bool = False
    in_flight: int = 0
    # engine request ids now generating, so a drain that times out can abort them
    active_requests: set[str] = field(default_factory=set)
    created: float = 0.0
    # streams a gateway can continue elsewhere: request id -> what ends them with a hand-over
    handovers: dict[str, Callable[[], bool]] = field(default_factory=dict)
    lora_sources: dict[str, str] = field(default_factory=dict)  # adapter name -> path or URI given
    idle: asyncio.Event | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def hand_over_streams(self) -> int:
        """End every stream a gateway can continue elsewhere (a drain); how many."""
        ends = list(self.handovers.values())
        self.handovers.clear()
        return sum(end() for end in ends)

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.idle is not None:
            self.idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within `timeout` seconds."""
        if self.in_flight == 0:
            return True
        self.idle = asyncio.Event()
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.idle = None
