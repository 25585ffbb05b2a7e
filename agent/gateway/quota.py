"""Token quotas and rate limits of API keys: token buckets, plain and clock-injected.

Every limit is a bucket that holds up to `capacity` units and refills continuously at
`capacity / period` per second (OpenAI's semantics: a key with 2,000 tokens/minute may
spend 2,000 at once, then about 33 a second). A request is admitted only when every bucket
that applies to it (the key's tokens/minute, requests/minute and tokens/day, and the same
for the deployment it names) holds its cost; it then takes its cost from all of them.

The token cost at admission is prompt tokens (counted with the deployment's tokenizer)
plus max_tokens per sequence; when the response ends the reservation is settled to the
tokens the engine reports, refunding what was not generated. The bound (docs/quotas.md):
over any interval T a bucket admits at most `capacity + rate * T` units, plus, only if a
settlement charges more than was reserved (a prompt under-counted by the fallback
estimate), that excess; the excess is charged as debt, so later admissions pay for it.

In several regions each gateway's buckets (tokens and requests) are scaled by its
cluster's share of the key's budget (`ApiKeyRecord.shares`; docs/quotas.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet_base.api_keys import ApiKeyRecord, DeploymentLimits, Quotas
from fleet_base.token_bucket import TokenBucket

MINUTE_S = 60.0
DAY_MINUTES = 1440.0


# --------------------------------------------------------------------- per key


@dataclass(frozen=True)
class Limit:
    """One bucket's definition: what it counts, its capacity and refill period."""

    name: str  # "tpm", "rpm", "tpd", or "<deployment>:tpm", ...
    unit: str  # "tokens" | "requests"
    capacity: float
    period_s: float


def limits_for(
    quotas: Quotas, deployment: str, share: float, minute_s: float = MINUTE_S, adapter: str | None = None
) -> list[Limit]:
    """The buckets a request of this key on `deployment` must pass, capacities scaled by
    this cluster's share of the key's budget (at least 1 each). A request for a LoRA
    `adapter` also passes the limits `quotas.deployments` sets under the adapter's name."""
    day_s = minute_s * DAY_MINUTES
    out: list[Limit] = []

    def add(prefix: str, tpm: int | None, rpm: int | None, tpd: int | None) -> None:
        if tpm is not None:
            out.append(Limit(f"{prefix}tpm", "tokens", max(1.0, tpm * share), minute_s))
        if rpm is not None:
            out.append(Limit(f"{prefix}rpm", "requests", max(1.0, rpm * share), minute_s))
        if tpd is not None:
            out.append(Limit(f"{prefix}tpd", "tokens", max(1.0, tpd * share), day_s))

    add("", quotas.tokens_per_minute, quotas.requests_per_minute, quotas.tokens_per_day)
    per: DeploymentLimits | None = quotas.deployments.get(deployment)
    if per is not None:
        add(f"{deployment}:", per.tokens_per_minute, per.requests_per_minute, per.tokens_per_day)
    own = quotas.deployments.get(adapter) if adapter is not None and adapter != deployment else None
    if own is not None:
        add(f"{adapter}:", own.tokens_per_minute, own.requests_per_minute, own.tokens_per_day)
    return out


@dataclass
class RateStatus:
    """What the x-ratelimit-* headers say: the binding request and token limits."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_s)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_s)
        return out


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "0s", "120ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


@dataclass
class Reservation:
    """What one admitted request took, to settle when its response ends."""

    key_id: str
    deployment: str
    tokens: int
    names: tuple[str, ...]  # the token buckets charged
    settled: bool = False


@dataclass
class Decision:
    admitted: bool
    status: RateStatus
    reservation: Reservation | None = None
    retry_after_s: float = 0.0
    reason: str = ""  # which limit refused ("tpm", "rpm", "tiny:tpd", ...)
    never: bool = False  # the cost exceeds the limit's capacity: no wait helps


@dataclass
class _KeyState:
    buckets: dict[str, TokenBucket] = field(default_factory=dict)


class QuotaBook:
    """The buckets of every key this gateway has seen; the gateway's quota policy.

    Plain and synchronous: `now` comes from the injected clock, so tests drive time."""

    def __init__(self, clock: Callable[[], float], minute_s: float = MINUTE_S) -> None:
        self.clock = clock
        self.minute_s = minute_s
        self._keys: dict[str, _KeyState] = {}

    def _buckets(self, key_id: str, limits: list[Limit], now: float) -> dict[str, TokenBucket]:
        state = self._keys.setdefault(key_id, _KeyState())
        for lim in limits:
            b = state.buckets.get(lim.name)
            if b is None:
                state.buckets[lim.name] = TokenBucket.full(lim.capacity, lim.period_s, now)
            elif b.capacity != lim.capacity or not math.isclose(b.rate * lim.period_s, lim.capacity):
                b.resize(lim.capacity, lim.period_s, now)
        return {lim.name: state.buckets[lim.name] for lim in limits}

    def admit(
        self, key: ApiKeyRecord, deployment: str, tokens: int, share: float = 1.0, adapter: str | None = None
    ) -> Decision:
        """Admit a request that may cost `tokens` (prompt + max completion) or say why not."""
        now = self.clock()
        limits = limits_for(key.quotas, deployment, share, self.minute_s, adapter)
        buckets = self._buckets(key.key_id, limits, now)
        cost = {lim.name: (tokens if lim.unit == "tokens" else 1) for lim in limits}
        blocked = [lim for lim in limits if not buckets[lim.name].fits(cost[lim.name], now)]
        if blocked:
            waits = {lim.name: buckets[lim.name].wait_s(cost[lim.name], now) for lim in blocked}
            worst = max(waits, key=lambda n: waits[n])
            never = math.isinf(waits[worst])
            return Decision(
                admitted=False,
                status=self._status(limits, buckets, now),
                retry_after_s=0.0 if never else waits[worst],
                reason=worst,
                never=never,
            )
        for lim in limits:
            buckets[lim.name].take(cost[lim.name], now)
        names = tuple(lim.name for lim in limits if lim.unit == "tokens")
        reservation = Reservation(key.key_id, deployment, tokens, names)
        return Decision(admitted=True, status=self._status(limits, buckets, now), reservation=reservation)

    def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """The response ended: the key pays `actual_tokens` instead of the reservation."""
        if reservation.settled:
            return
        reservation.settled = True
        delta = reservation.tokens - actual_tokens
        if delta == 0:
            return
        now = self.clock()
        state = self._keys.get(reservation.key_id)
        if state is None:
            return
        for name in reservation.names:
            b = state.buckets.get(name)
            if b is not None:
                b.adjust(delta, now)

    def status(self, key: ApiKeyRecord, deployment: str, share: float = 1.0) -> RateStatus:
        now = self.clock()
        limits = limits_for(key.quotas, deployment, share, self.minute_s)
        return self._status(limits, self._buckets(key.key_id, limits, now), now)

    def _status(self, limits: list[Limit], buckets: dict[str, TokenBucket], now: float) -> RateStatus:
        """The binding limits: of each unit, the bucket with the least left."""
        status = RateStatus()
        for unit in ("requests", "tokens"):
            mine = [lim for lim in limits if lim.unit == unit]
            if not mine:
                continue
            lim = min(mine, key=lambda x: (buckets[x.name].available(now), x.name))
            b = buckets[lim.name]
            values = (int(lim.capacity), max(0, math.floor(b.available(now))), b.reset_s(now))
            if unit == "requests":
                status.limit_requests, status.remaining_requests, status.reset_requests_s = values
            else:
                status.limit_tokens, status.remaining_tokens, status.reset_tokens_s = values
        return status

    def prime(self, keys: list[ApiKeyRecord], share: float | Callable[[ApiKeyRecord], float] = 1.0) -> None:
        """Create the buckets of limited keys as soon as they are known (not at their first
        request), so a share raised meanwhile cannot hand out a fresh full bucket."""
        for key in keys:
            if not key.quotas.limited():
                continue
            s = share(key) if callable(share) else share
            for deployment in ["", *key.quotas.deployments]:
                self.status(key, deployment, s)
        self.forget({k.key_id for k in keys})

    def forget(self, live_keys: set[str]) -> None:
        """Drop the buckets of keys that no longer exist."""
        for key_id in set(self._keys) - live_keys:
            del self._keys[key_id]


def share_of(key: ApiKeyRecord, cluster: str) -> float:
    """This cluster's fraction of the key's token budgets: its published share; the smallest
    published share for a cluster the control plane has not given one yet; 1 when none."""
    if not key.shares:
        return 1.0
    if cluster in key.shares:
        return min(1.0, max(0.0, key.shares[cluster]))
    return min(1.0, max(0.0, min(key.shares.values())))
