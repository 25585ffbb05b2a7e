"""The base of every request model: strict types, unknown fields ignored, null = default."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Strict(BaseModel):
    """Strict types; an explicit JSON null means "use the default" (many clients send nulls)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data
