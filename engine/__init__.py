"""Fleet's inference engine. Heavy parts (torch) load lazily, so `engine.tokenizer` and
`fleet_base.sampling_params` stay cheap to import for the gateway."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleet_base.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.llm import LLM

__all__ = ["LLM", "AsyncLLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
