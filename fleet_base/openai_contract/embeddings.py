"""POST /v1/embeddings: the request body and the limits on it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from fleet_base.openai_contract.base import Strict

MAX_EMBEDDING_INPUTS = 2048


def _check_input(v: object) -> object:
    shape = "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(v, str):
        if not v:
            raise ValueError("input must not be an empty string")
        return v
    if not isinstance(v, list):
        raise ValueError(shape)
    if not v:
        raise ValueError("input must not be an empty list")
    if len(v) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed per request, got {len(v)}")
    if all(isinstance(x, str) for x in v):
        if any(not x for x in v):
            raise ValueError("input must not contain empty strings")
        return v
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    if all(isinstance(x, list) for x in v):
        for ids in v:
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("each token-id input must be a non-empty list of integers")
        return v
    raise ValueError(shape)


class EmbeddingRequest(Strict):
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, v: object) -> object:
        return _check_input(v)

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of single inputs (strings or token-id lists)."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if isinstance(v[0], int):
            return [list(v)]
        return list(v)
