"""The gateway's side of quotas: admit or refuse (429 with Retry-After and OpenAI's
x-ratelimit-* headers), and settle each admitted request to the engine's usage.

The decisions are `agent.gateway.quota.QuotaBook`'s; this module turns them into HTTP and
metrics and picks the key's share of the budget for this cluster.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from agent.gateway.errors import GatewayError
from agent.gateway.inputs import RequestInfo
from agent.gateway.metrics import GatewayMetrics
from agent.gateway.quota import MINUTE_S, QuotaBook, Reservation, limits_for, share_of
from fleet_base.api_keys import ApiKeyRecord


def budget_spent(key: ApiKeyRecord) -> GatewayError:
    """The key's team has a hard monthly budget and spent it (the control plane marks the
    key): OpenAI's answer to an account out of credit, no Retry-After (it lasts until the
    budget is raised or the month ends)."""
    team = f"team '{key.team}'" if key.team else "this key's team"
    return GatewayError(
        429,
        f"The monthly budget of {team} is spent: new requests are refused until the budget is raised "
        "or the next calendar month (UTC) begins",
        code="insufficient_quota",
        kind="insufficient_quota",
    )


class QuotaGate:
    def __init__(
        self,
        cluster: str,
        metrics: GatewayMetrics,
        *,
        minute_s: float = MINUTE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.book = QuotaBook(clock, minute_s)

    def admit(
        self,
        key: ApiKeyRecord,
        info: RequestInfo,
        worst_tokens: int | None = None,
        adapter: str | None = None,
    ) -> tuple[Reservation | None, dict[str, str]]:
        """(reservation to settle, headers for the response); GatewayError 429 when over.
        `worst_tokens` (no max_tokens: the context left) is reserved up to the key's
        smallest token budget here, so such a request is never refused outright."""
        if key.budget_exhausted:
            self.metrics.rate_limited.labels(info.deployment, "budget").inc()
            raise budget_spent(key)
        if not key.quotas.limited():
            return None, {}
        share = share_of(key, self.cluster)
        tokens = info.cost_tokens
        if worst_tokens is not None and worst_tokens > tokens:
            limits = limits_for(key.quotas, info.deployment, share, self.book.minute_s, adapter)
            caps = [int(lim.capacity) for lim in limits if lim.unit == "tokens"]
            tokens = max(tokens, min([worst_tokens, *caps]))
        decision = self.book.admit(key, info.deployment, tokens, share, adapter)
        headers = decision.status.headers()
        if decision.admitted:
            return decision.reservation, headers
        self.metrics.rate_limited.labels(info.deployment, decision.reason.rsplit(":", 1)[-1]).inc()
        if decision.never:
            raise GatewayError(
                429,
                f"This request needs {info.cost_tokens} tokens (prompt + max_tokens), more than the key's "
                f"limit '{decision.reason}' allows at once here; lower max_tokens or the prompt",
                code="rate_limit_exceeded",
                headers=headers,
            )
        retry = max(1, math.ceil(decision.retry_after_s))
        unit = "requests" if decision.reason.endswith("rpm") else "tokens"
        raise GatewayError(
            429,
            f"Rate limit reached for this key ({decision.reason}, {unit}); retry in {retry} s",
            code="rate_limit_exceeded",
            headers={**headers, "Retry-After": str(retry)},
        )

    def settle(
        self, reservation: Reservation | None, usage: dict[str, Any], ran: bool, abandoned: int = 0
    ) -> None:
        """Charge the engine's count, plus the `abandoned` attempts' cost. Without usage: the
        whole reservation when a replica answered 2xx and may have generated (a cut
        stream), nothing otherwise (a peer's answer: that gateway charges the key)."""
        if reservation is None or reservation.settled:
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            answer = prompt + completion
        else:
            answer = reservation.tokens if ran else 0
        self.book.settle(reservation, answer + abandoned)

    def prime(self, keys: list[ApiKeyRecord]) -> None:
        """The keys file was reloaded: create new keys' buckets, drop deleted keys'."""
        self.book.prime([k for k in keys if not k.revoked], lambda k: share_of(k, self.cluster))

    def headers(self, key: ApiKeyRecord, deployment: str) -> dict[str, str]:
        if not key.quotas.limited():
            return {}
        return self.book.status(key, deployment, share_of(key, self.cluster)).headers()
