"""Per-request sampling parameters, validated at the edge so the engine never sees nonsense."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fleet_base.bounds import MAX_N, MAX_STOP_TOKEN_IDS, MAX_TOKENS, Seed, TokenId


class StructuredOutput(BaseModel):
    """A constraint on the text to generate: JSON matching `json_schema` (a JSON string), or
    any JSON object (`json_object`). The engine compiles it to a grammar once and masks
    every token that would leave it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_schema", "json_object"]
    json_schema: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> StructuredOutput:
        if (self.kind == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required for kind 'json_schema' and only for it")
        return self


class PoolingParams(BaseModel):
    """Embed the prompt instead of generating: pool the last hidden state over the prompt's
    tokens (`mean`) or take its last token's (`last`), L2-normalized unless told not to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling: Literal["mean", "last"] = "mean"
    normalize: bool = True


class SamplingParams(BaseModel):
    """What to generate for one request; mirrors the OpenAI / vLLM knobs.

    `temperature == 0` means greedy. `seed` makes sampling reproducible per request,
    independent of whatever else shares the batch.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKENS)  # -1 or 0: disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)  # None: up to the context window
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    ignore_eos: bool = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # top alternatives per sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None
    pooling: PoolingParams | None = None  # set: an embedding request (nothing is sampled)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def generation_limit(max_tokens: int | None, prompt_tokens: int, context_tokens: int) -> int:
    """The most tokens the engine generates for one sequence: `max_tokens`, or, when the
    request sets none (None), whatever the context window leaves after the prompt. The
    engine stops there and the gateway reserves quota for it, from this one rule."""
    return max_tokens if max_tokens is not None else context_tokens - prompt_tokens
