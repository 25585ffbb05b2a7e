"""Outstanding work this gateway has sent to each replica, and which replicas just failed.

Counts only this gateway's own requests (a replica shared with other gateways is balanced
from each side independently); the heartbeat's engine-side load can refine it later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet_base.kv_tier_cost import PendingPrefills, PrefillTiming


@dataclass
class _Load:
    tokens: int = 0
    requests: int = 0
    prefill: int = 0  # of `tokens`, new prefill with no first token yet
    pending: PendingPrefills = field(default_factory=PendingPrefills)  # that prefill, as sent

    def release(self, prefill: int) -> None:
        """One request's prefill is done (or gone): it no longer delays a new prompt."""
        self.prefill = max(0, self.prefill - prefill)
        if prefill > 0:
            self.pending.release(prefill)


class LoadTracker:
    def __init__(self, failure_window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_window_s = failure_window_s
        self.clock = clock
        self._load: dict[str, _Load] = {}
        self._failed_at: dict[str, float] = {}

    def start(self, replica_id: str, tokens: int, prefill: int = 0) -> None:
        load = self._load.setdefault(replica_id, _Load())
        load.tokens += tokens
        load.requests += 1
        load.prefill += prefill
        if prefill > 0:
            load.pending.add(self.clock(), prefill)

    def prefilled(self, replica_id: str, prefill: int) -> None:
        """A request's first token came: its prefill no longer delays a new prompt there."""
        load = self._load.get(replica_id)
        if load is not None:
            load.release(prefill)

    def finish(self, replica_id: str, tokens: int, prefill: int = 0) -> None:
        """A request left; `prefill`: what of its prefill was not released by `prefilled`."""
        load = self._load.get(replica_id)
        if load is None:
            return
        load.tokens = max(0, load.tokens - tokens)
        load.requests = max(0, load.requests - 1)
        load.release(prefill)
        if load.requests == 0:
            del self._load[replica_id]

    def outstanding(self, replica_id: str) -> int:
        load = self._load.get(replica_id)
        return load.tokens if load else 0

    def queued_prefill(self, replica_id: str) -> int:
        load = self._load.get(replica_id)
        return load.prefill if load else 0

    def pending_prefill(self, replica_id: str) -> tuple[tuple[float, int], ...]:
        """The queued prefill request by request: (sent at, by `clock`; new prefill tokens)."""
        load = self._load.get(replica_id)
        return load.pending.items() if load else ()

    def prefill_wait_s(self, replica_id: str, timing: PrefillTiming, *, short: bool = False) -> float:
        """Seconds before a new prompt's prefill could start there (`kv_tier_cost.queue_wait_s`)."""
        load = self._load.get(replica_id)
        return load.pending.wait_s(self.clock(), timing, short=short) if load else 0.0

    def in_flight(self, replica_id: str) -> int:
        load = self._load.get(replica_id)
        return load.requests if load else 0

    def mark_failed(self, replica_id: str) -> None:
        self._failed_at[replica_id] = self.clock()

    def recently_failed(self, replica_id: str) -> bool:
        at = self._failed_at.get(replica_id)
        if at is None:
            return False
        if self.clock() - at > self.failure_window_s:
            del self._failed_at[replica_id]
            return False
        return True

    def keep_only(self, live: set[str]) -> None:
        """Forget the failures of replicas the cluster no longer runs (nothing asks about
        them again, so their entries would otherwise stay)."""
        for replica_id in [r for r in self._failed_at if r not in live]:
            del self._failed_at[replica_id]

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """replica id -> (outstanding tokens, requests in flight)."""
        return {rid: (load.tokens, load.requests) for rid, load in self._load.items()}
