"""The speculative-decoding setting, in vLLM's `speculative_config` names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 64
# Drafting stops for a step once this many sequences decode in it (measured: docs/engine.md
# "Speculative decoding", Measured "with the gate").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


class SpeculativeConfig(BaseModel):
    """n-gram (prompt lookup) drafting: match the last `prompt_lookup_max` .. `prompt_lookup_min`
    tokens against earlier tokens of the same sequence and propose the `num_speculative_tokens`
    that followed, in steps where fewer than `disable_by_batch_size` sequences decode (None:
    any batch). Same field names as vLLM's `speculative_config={"method": "ngram", ...}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(5, ge=1, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_NGRAM)
    prompt_lookup_min: int = Field(2, ge=1, le=MAX_NGRAM)
    disable_by_batch_size: int | None = Field(DEFAULT_DISABLE_BY_BATCH_SIZE, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self


# What EngineArgs and the server use when nothing is said: on, gated at batch 4 (measured
# in docs/engine.md "Speculative decoding": it wins at batch 1 and the gate makes a batch-16
# step an unspeculated one). `speculative_config=None` / `--speculative none` turns it off.
DEFAULT_SPECULATIVE_CONFIG: SpeculativeConfig | None = SpeculativeConfig()
