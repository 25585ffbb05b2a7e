"""A work item's run through the gateway, as the worker sees it: the body sent (always
whole: a batch line's answer is stored, never streamed) and what came back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from agent.gateway.inputs import Endpoint
from agent.gateway.upstream import PATHS
from fleet_base.protocol import UsageRecord

ENDPOINTS: dict[str, Endpoint] = {path: endpoint for endpoint, path in PATHS.items()}  # type: ignore[misc]


def retried(status: int) -> bool:
    """An answer the worker runs the line again for, later: a server failure the gateway's
    own retries did not get past, or a refusal for now (a quota, a full queue)."""
    return status >= 500 or status == 429


def whole_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The line's body asking for a whole answer (its stream settings dropped)."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


@dataclass(frozen=True)
class WorkOutcome:
    status: int
    body: Any  # the answer's JSON (an OpenAI error object when it failed), else its text
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # the run's usage record, held back: the worker books it only when this run's result
    # is the line's (its `put_result` won); None when nothing was served or refused
    record: UsageRecord | None = None

    @classmethod
    def of(
        cls, response: Response, usage: Mapping[str, Any] | None = None, record: UsageRecord | None = None
    ) -> WorkOutcome:
        raw = bytes(response.body) if getattr(response, "body", None) is not None else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        usage = usage or {}
        return cls(
            response.status_code,
            body,
            _count(usage.get("prompt_tokens")),
            _count(usage.get("completion_tokens")),
            record,
        )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
