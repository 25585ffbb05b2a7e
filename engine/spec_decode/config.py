"""The speculative-decoding setting, in vLLM's `speculative_config` names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 64


class SpeculativeConfig(BaseModel):
    """n-gram (prompt lookup) drafting: match the last `prompt_lookup_max` .. `prompt_lookup_min`
    tokens against earlier tokens of the same sequence and propose the `num_speculative_tokens`
    that followed. Same field names as vLLM's `speculative_config={"method": "ngram", ...}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(5, ge=1, le=MAX_SPECULATIVE_TOKENS)
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_NGRAM)
    prompt_lookup_min: int = Field(2, ge=1, le=MAX_NGRAM)

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        return self
